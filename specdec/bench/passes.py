"""Untimed analysis passes (``specdec bench --analysis``): where acceptance happens, and
how uncertain the target was there. Each is one extra drive over a set's prompts.

- ``trace_steps``: every verify step of every request as (position, drafted, accepted),
  read from DELTA outputs: a request's ``RequestMetrics`` spec counters grow by one step
  exactly when that step verified a draft. ``position`` is the output index of the
  first token the step emitted; its drafts proposed positions ``position``,
  ``position + 1``, ...; the first ``accepted`` matched, the next (if any) did not.
- ``target_entropy``: the target's next-token entropy (nats) at each output position of
  plain greedy decoding, from the engine's top-20 logprobs. The mass outside the top 20
  counts as one outcome, so the figure is a lower bound on the true entropy (tight when
  the distribution is peaked, which is where drafts get accepted).
- ``vocab_coverage``: the fraction of output tokens a draft head could have proposed at
  all (marked in its ``t2d``); None for proposers without a draft vocabulary.
- ``divergence_gaps``: where a speculative output first leaves plain decoding's, how far
  plain decoding was from picking the speculative token there (``Divergence``). Greedy
  speculation is lossless in exact arithmetic; in bf16 the verify forward runs other GEMM
  shapes than plain decoding's, so a near-tie can flip. A gap near 0 is such a flip, a
  large one a token plain decoding would never pick (a bug). Always on: it costs one
  one-token request per distinct divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.bench.driver import RunParams, drive
from specdec.bench.measure import first_difference
from specdec.engine.llm import LLM
from specdec.sampling_params import MAX_LOGPROBS, RequestOutputKind

Step = tuple[int, int, int]  # (output position of the step's first token, drafted, accepted)


def trace_steps(llm: LLM, prompts: list[list[int]], run: RunParams) -> list[list[Step]]:
    """Per prompt, its verify steps in order (module docstring)."""
    params = run.sampling(output_kind=RequestOutputKind.DELTA)
    traces: list[list[Step]] = [[] for _ in prompts]
    emitted = [0] * len(prompts)  # output tokens so far
    last = [(0, 0, 0)] * len(prompts)  # (steps, drafted, accepted) at the previous output
    for i, out in drive(llm.engine, prompts, params, run.concurrency):
        m = out.metrics
        now = (m.spec_steps, m.spec_drafted_tokens, m.spec_accepted_tokens)
        steps, drafted, accepted = (a - b for a, b in zip(now, last[i], strict=True))
        if steps > 1:
            raise RuntimeError(f"one output covers {steps} verify steps; expected one per step")
        if steps:
            traces[i].append((emitted[i], drafted, accepted))
        emitted[i] += len(out.outputs[0].token_ids)
        last[i] = now
    return traces


def entropy_from_top(logprobs: list[float]) -> float:
    """Entropy (nats) of a distribution known by its top logprobs, the rest lumped into
    one outcome: a lower bound on the entropy of the full distribution."""
    probs = [math.exp(lp) for lp in logprobs]
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * math.log(p) for p in [*probs, rest] if p > 0)


def target_entropy(
    llm: LLM, prompts: list[list[int]], run: RunParams
) -> tuple[list[list[float]], list[list[int]]]:
    """Per prompt: the entropy at each output position, and the output ids (plain greedy
    decoding: requests asking for logprobs never speculate)."""
    params = run.sampling(logprobs=MAX_LOGPROBS)
    entropies: list[list[float]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, out in drive(llm.engine, prompts, params, run.concurrency):
        if out.finished:
            completion = out.outputs[0]
            outputs[i] = list(completion.token_ids)
            entropies[i] = [entropy_from_top(list(lp.top.values())) for lp in completion.logprobs]
    return entropies, outputs


def draft_vocab(llm: LLM) -> torch.Tensor | None:
    """The proposer's ``t2d`` ([target_vocab] bool, the target ids its head can draft),
    or None when it drafts from the whole vocabulary or has no head (ngram, draft model)."""
    head = getattr(llm.engine.proposer, "head", None)
    t2d = getattr(head, "t2d", None)
    return t2d.detach().to("cpu", torch.bool) if isinstance(t2d, torch.Tensor) else None


def vocab_coverage(t2d: torch.Tensor | None, outputs: list[list[int]]) -> float | None:
    """Fraction of the tokens in ``outputs`` marked in ``t2d``; None without a ``t2d``."""
    if t2d is None:
        return None
    ids = torch.tensor([t for out in outputs for t in out], dtype=torch.int64)
    return float(t2d[ids].float().mean()) if ids.numel() else None


@dataclass(frozen=True)
class Divergence:
    """Where a speculative output first differs from the reference (plain decoding's) for
    one request: output index ``at``, the reference's token there and the speculative
    one. Outputs that differ only in length (one stopped earlier) have none."""

    request: int
    at: int
    reference_token: int
    spec_token: int


def first_divergences(outputs: list[list[int]], reference: list[list[int]]) -> list[Divergence]:
    """Per request whose output differs from its reference within both lengths, its first
    difference (``outputs[i]`` and ``reference[i]`` are the same request's)."""
    found = []
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        at = first_difference(out, ref)
        if at is not None:
            found.append(Divergence(i, at, ref[at], out[at]))
    return found


def divergence_gaps(
    llm: LLM,
    requests: list[list[int]],
    reference: list[list[int]],
    divergences: list[Divergence],
) -> list[float]:
    """Per divergence, in order: plain decoding's logprob of the reference token minus its
    logprob of the speculative token, with the request's prompt and its reference output
    before ``at`` as the prompt (one greedy token, top-``MAX_LOGPROBS`` logprobs; each
    distinct prompt runs once, all at once). Near 0: a near-tie that rounding can flip
    (negative when this rerun itself prefers the speculative token). A token outside the
    top ``MAX_LOGPROBS`` counts at the last listed logprob, so a speculative token there
    gives a lower bound on the gap."""
    if not divergences:
        return []
    keys = list(dict.fromkeys((d.request, d.at) for d in divergences))
    prompts = [requests[r] + reference[r][:at] for r, at in keys]
    params = RunParams(max_tokens=1).sampling(logprobs=MAX_LOGPROBS)
    top: dict[tuple[int, int], dict[int, float]] = {}
    for i, out in drive(llm.engine, prompts, params):
        if out.finished:
            top[keys[i]] = out.outputs[0].logprobs[0].top
    gaps = []
    for d in divergences:
        lps = top[(d.request, d.at)]
        floor = min(lps.values())
        gaps.append(lps.get(d.reference_token, floor) - lps.get(d.spec_token, floor))
    return gaps
