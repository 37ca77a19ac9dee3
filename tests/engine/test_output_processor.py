"""``OutputProcessor`` (engine/output_processor.py): appending tokens and building each
step's outputs, with the real SmolLM2 tokenizer and no model. Stop conditions in their
order of precedence (min_tokens first, then EOS, stop ids, stop strings, then the length
limits), and every output kind reporting the same tokens and text."""

from __future__ import annotations

import pytest

from specdec.engine.block_pool import BlockPool
from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.scheduler import Scheduler
from specdec.outputs import TokenDelta
from specdec.request import Request, RequestStatus
from specdec.sampling_params import RequestOutputKind, SamplingParams

EOS = 2
MAX_MODEL_LEN = 64


@pytest.fixture
def processor(smollm2_tokenizer):
    from specdec.config import SchedulerConfig

    kv = KVCacheManager(BlockPool(64, enable_prefix_caching=False), 16)
    scheduler = Scheduler(SchedulerConfig(), kv, MAX_MODEL_LEN)
    released: list[str] = []
    out = OutputProcessor(lambda: smollm2_tokenizer, scheduler, MAX_MODEL_LEN, released.append)
    out.released = released
    return out


def _add(processor, params: SamplingParams, prompt=(1, 2, 3), request_id="r") -> Request:
    max_tokens = params.max_tokens or MAX_MODEL_LEN - len(prompt)
    request = Request(request_id, list(prompt), params, (EOS,), max_tokens)
    processor.scheduler.add_request(request)
    processor.add(request, None)
    return request


def _feed(processor, request: Request, tokens: list[int]) -> list:
    """Append ``tokens`` one by one until the request finishes; every output reported."""
    state = processor.states[request.request_id]
    outputs: list = []
    for token in tokens:
        processor.append_token(state, token, None, 0.0)
        processor.report(state, outputs)
        if request.is_finished:
            break
    return outputs


@pytest.mark.parametrize(
    ("params", "tokens", "kept", "status", "reason"),
    [
        (SamplingParams(max_tokens=8), [5, 6, EOS, 7], 3, RequestStatus.FINISHED_STOPPED, None),
        (SamplingParams(max_tokens=8, ignore_eos=True), [5, EOS, 6], 3, None, None),
        (SamplingParams(max_tokens=8, stop_token_ids=[6]), [5, 6, 7], 2, "stop", 6),
        (SamplingParams(max_tokens=3), [5, 6, 7, 8], 3, RequestStatus.FINISHED_LENGTH, None),
        (SamplingParams(max_tokens=8, min_tokens=3), [EOS, 6, EOS], 3, "stop", None),
    ],
    ids=["eos", "ignore-eos", "stop-id", "max-tokens", "min-tokens-first"],
)
def test_stop_conditions(processor, params, tokens, kept, status, reason):
    request = _add(processor, params)
    _feed(processor, request, tokens)
    assert request.output_token_ids == tokens[:kept]
    expected = {"stop": RequestStatus.FINISHED_STOPPED}.get(status, status)
    assert request.status == (expected or RequestStatus.WAITING)
    if expected is not None:
        assert request.stop_reason == reason
        assert request.request_id not in processor.states  # forgotten once reported
        assert processor.released == [request.request_id]


def test_the_context_limit_ends_a_request(processor):
    prompt = tuple(range(10, 10 + MAX_MODEL_LEN - 2))
    request = _add(processor, SamplingParams(max_tokens=None, ignore_eos=True), prompt)
    _feed(processor, request, [5, 6, 7])
    assert request.output_token_ids == [5, 6]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_a_stop_string_ends_the_text_before_it(processor, smollm2_tokenizer):
    tokens = smollm2_tokenizer.encode("Hello world. Goodbye", add_special_tokens=False)
    request = _add(processor, SamplingParams(max_tokens=32, stop=["."]))
    outputs = _feed(processor, request, tokens)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == "."
    assert outputs[-1].outputs[0].text == "Hello world"
    assert outputs[-1].finished


def test_every_output_kind_reports_the_same_tokens_and_text(processor, smollm2_tokenizer):
    tokens = smollm2_tokenizer.encode("One two three four.", add_special_tokens=False)
    n = len(tokens)
    got = {}
    for kind in RequestOutputKind:
        params = SamplingParams(max_tokens=n, output_kind=kind)
        outs = _feed(processor, _add(processor, params, request_id=kind.name), tokens)
        if kind is RequestOutputKind.TOKENS:
            assert all(isinstance(o, TokenDelta) for o in outs)
            got[kind] = ([t for o in outs for t in o.token_ids], None)
            assert outs[-1].finish_reason == "length" and outs[-1].metrics is not None
        elif kind is RequestOutputKind.DELTA:
            assert len(outs) == n
            got[kind] = (
                [t for o in outs for t in o.outputs[0].token_ids],
                "".join(o.outputs[0].text for o in outs),
            )
        else:
            assert len(outs) == (1 if kind is RequestOutputKind.FINAL_ONLY else n)
            got[kind] = (outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text)
        if kind is not RequestOutputKind.TOKENS:
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    text = smollm2_tokenizer.decode(tokens, skip_special_tokens=True)
    for kind, (ids, decoded) in got.items():
        assert ids == tokens, kind
        if decoded is not None:
            assert decoded == text, kind
