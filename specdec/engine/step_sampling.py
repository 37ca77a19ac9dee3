"""Picking each plain row's token from a step's logits, and the request rules that decide
which rows may go through a draft tree at all.

Greedy rows without logprobs take the argmax (no sampling tensors); the rest go through
the ``Sampler`` with their seeded streams. Rows below ``min_tokens`` have EOS and their
stop ids masked first, so the distribution sampled is the target's renormalised over the
other tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.device.staging import to_device
from specdec.engine.output_processor import RequestState
from specdec.outputs import TokenLogprobs
from specdec.request import Request
from specdec.sampling.sampler import LogprobsTensors, Sampler, SamplingMetadata


class StepSampler:
    """One token per row of [rows, vocab] logits for the requests ``states`` (row order)."""

    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler = sampler
        self.device = device

    def on_device(
        self, states: list[RequestState], logits: torch.Tensor
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:  # [rows] int64, logprobs
        """The tokens left on the device (async steps read them a step later)."""
        params = [st.request.sampling_params for st in states]
        suppress_early_stops(logits, [st.request for st in states])
        if all(p.is_greedy and p.logprobs is None for p in params):
            return logits.argmax(dim=-1), None  # no sampling tensors needed
        meta = SamplingMetadata.build(params, [st.stream for st in states], self.device)
        sampled = self.sampler(logits, meta)
        return sampled.token_ids, sampled.logprobs

    def to_host(
        self, states: list[RequestState], logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """The tokens and their logprobs on the host (the step's host sync)."""
        tokens, logprobs = self.on_device(states, logits)
        token_ids = tokens.tolist()
        return token_ids, logprobs_to_host(logprobs, token_ids)


def suppress_early_stops(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rows below ``min_tokens`` must not produce EOS or a stop token id: mask them
    (in place, so the sampled distribution is the target's renormalised over the rest).
    One staged index copy for the batch: indexing with a Python list would copy from
    pageable memory, which waits for the step in flight."""
    rows: list[int] = []
    cols: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        # The row samples output token num_output + pending (async scheduling).
        if request.num_output_tokens + request.num_pending_tokens >= params.min_tokens:
            continue
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += request.eos_token_ids
        rows += [row] * len(banned)
        cols += banned
    if rows:
        index = to_device(np.array([rows, cols], dtype=np.int64), logits.device)
        logits[index[0], index[1]] = float("-inf")


def samples_per_token(request: Request) -> bool:
    """logprobs and min_tokens act per emitted token: such rows are sampled plainly, never
    through a tree (not even a root-only one)."""
    params = request.sampling_params
    return params.logprobs is not None or request.num_output_tokens < params.min_tokens


def decodes_plainly(request: Request) -> bool:
    """No drafts: the request opted out of speculation, or samples per token."""
    return not request.sampling_params.speculate or samples_per_token(request)


def logprobs_to_host(lp: LogprobsTensors | None, token_ids: list[int]) -> list[TokenLogprobs]:
    """Batch logprobs to host objects (top-n holds the batch's largest n; rows slice)."""
    if lp is None:
        return []
    top_ids = lp.top_token_ids.tolist()
    top_lps = lp.top_logprobs.tolist()
    sampled = lp.sampled_logprobs.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=s, top=dict(zip(ids, lps, strict=True)))
        for t, ids, lps, s in zip(token_ids, top_ids, top_lps, sampled, strict=True)
    ]
