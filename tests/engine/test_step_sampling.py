"""Plain rows' sampling (engine/step_sampling.py), on made-up logits: rows below
``min_tokens`` never yield EOS or a stop id (with or without the step in flight counted),
greedy rows take the argmax without the sampler, and logprobs come back per row."""

from __future__ import annotations

import torch

from specdec.engine.output_processor import RequestState
from specdec.engine.step_sampling import (
    StepSampler,
    decodes_plainly,
    samples_per_token,
    suppress_early_stops,
)
from specdec.request import Request
from specdec.sampling.sampler import Sampler
from specdec.sampling_params import SamplingParams

EOS, VOCAB = 2, 16


def _request(params: SamplingParams, outputs: int = 0, pending: int = 0) -> Request:
    request = Request("r", [1, 3], params, (EOS,), 32)
    request.output_token_ids = [5] * outputs
    request.num_pending_tokens = pending
    return request


def _state(request: Request) -> RequestState:
    return RequestState(request=request, prompt=None, detokenizer=None, stream=None)


def test_rows_below_min_tokens_cannot_stop():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = logits[:, 7] = 10.0  # EOS and stop id 7 would win everywhere
    rows = [
        _request(SamplingParams(min_tokens=2, stop_token_ids=[7])),  # below: both masked
        _request(SamplingParams(min_tokens=2, stop_token_ids=[7]), outputs=1, pending=1),
        _request(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[7])),
        _request(SamplingParams(min_tokens=0, stop_token_ids=[7])),
    ]
    suppress_early_stops(logits, rows)
    inf = float("-inf")
    assert logits[0, EOS] == inf and logits[0, 7] == inf
    assert logits[1, EOS] == 10.0 and logits[1, 7] == 10.0  # output + pending reach 2
    assert logits[2, EOS] == 10.0 and logits[2, 7] == inf  # ignore_eos: only the stop id
    assert logits[3, EOS] == 10.0 and logits[3, 7] == 10.0


class CountingSampler(Sampler):
    calls = 0

    def __call__(self, logits, meta):
        self.calls += 1
        return super().__call__(logits, meta)


def test_greedy_rows_take_the_argmax_and_logprobs_come_back_per_row():
    sampler = CountingSampler(torch.Generator().manual_seed(0))
    step = StepSampler(sampler, torch.device("cpu"))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    greedy = [_state(_request(SamplingParams(temperature=0))) for _ in range(3)]
    tokens, logprobs = step.to_host(greedy, logits.clone())
    assert tokens == logits.argmax(-1).tolist() and logprobs == [] and not sampler.calls
    with_lp = [_state(_request(SamplingParams(temperature=0, logprobs=2))) for _ in range(3)]
    tokens, logprobs = step.to_host(with_lp, logits.clone())
    assert sampler.calls == 1 and tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)
    for row, lp in enumerate(logprobs):
        assert lp.token_id == tokens[row]
        assert abs(lp.logprob - float(expected[row, tokens[row]])) < 1e-5
        assert len(lp.top) == 2 and tokens[row] in lp.top


def test_which_rows_decode_plainly():
    assert not decodes_plainly(_request(SamplingParams()))
    assert decodes_plainly(_request(SamplingParams(speculate=False)))
    assert samples_per_token(_request(SamplingParams(logprobs=0)))
    assert samples_per_token(_request(SamplingParams(min_tokens=3), outputs=2))
    assert not samples_per_token(_request(SamplingParams(min_tokens=3), outputs=3))
