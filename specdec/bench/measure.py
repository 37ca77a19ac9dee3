"""Interleaved timing and the summaries every report row is built from.

Interleaving: after ``warmup`` untimed runs of each contender, ``repeats`` rounds each run
every contender once, in the given order on even rounds and reversed on odd ones, so no
contender always goes first (cache state, clocks and background load drift over a run;
what drifts hits both sides alike). Figures are medians over the rounds.

A contender's tokens/s is the median of its runs' rates (output tokens / seconds);
speedup = spec tokens/s ÷ plain tokens/s of runs interleaved with each other. TTFT and
TPOT are medians over every request of every timed run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from specdec.bench.driver import Run, RunParams, generate
from specdec.engine.llm import LLM
from specdec.spec.metrics import SpecStats

WARMUP_TOKENS = 16


def measure_interleaved(
    contenders: dict[str, Callable[[], Run]],
    repeats: int,
    warmups: dict[str, Callable[[], object]] | None = None,
    warmup: int = 1,
) -> dict[str, list[Run]]:
    """``repeats`` timed runs per contender, interleaved (module docstring)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            (warmups or contenders).get(name, contenders[name])()
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            runs[name].append(contenders[name]())
    return runs


def measure_engines(
    llms: dict[str, LLM], prompts: list[list[int]], run: RunParams, repeats: int, warmup: int
) -> dict[str, list[Run]]:
    """Interleaved ``generate`` runs of each engine over the same prompts. A warm-up run
    generates ``WARMUP_TOKENS`` for the first ``2 * run.concurrency`` prompts: the batch
    shapes the timed runs start with, then arrivals next to running requests (compiled
    kernels, CUDA graphs, the allocator, and whatever an arrival step first compiles).
    Warmed on the first ``concurrency`` prompts only, the first engine a process measures
    runs its first repeat slower than the rest (H200, concurrency 4: 0.54 s, then 0.46 s),
    which would bias whichever engine comes first."""
    warm = replace(run, max_tokens=min(WARMUP_TOKENS, run.max_tokens))
    warm_prompts = prompts[: 2 * run.concurrency] if run.concurrency else prompts
    return measure_interleaved(
        {name: partial(generate, llm, prompts, run) for name, llm in llms.items()},
        repeats,
        warmups={name: partial(generate, llm, warm_prompts, warm) for name, llm in llms.items()},
        warmup=warmup,
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class Timing:
    """How fast one contender ran over the timed runs (module docstring for medians)."""

    tokens_per_s: float
    seconds: list[float]  # every timed run, in order
    output_tokens: int  # of the first timed run (greedy: every run emits the same)
    ttft_s: float | None
    tpot_s: float | None
    engine_steps: float = 0.0  # per run, mean
    mean_in_flight: float = 0.0  # requests in flight per engine step, mean over runs
    # Share of the wall time run at a full batch (the rest: filling and draining), mean over
    # runs: where two contenders' tok/s differ more than their full-batch steps do.
    full_batch_share: float = 0.0
    graph_steps: float = 0.0  # per run, mean: target forwards replayed from a CUDA graph
    draft_graph_steps: float = 0.0  # per run, mean: proposals replayed from graphs

    @classmethod
    def of(cls, runs: list[Run]) -> Timing:
        requests = [q for r in runs for q in r.requests]
        return cls(
            tokens_per_s=statistics.median(r.tokens_per_s for r in runs),
            seconds=[r.seconds for r in runs],
            output_tokens=runs[0].output_tokens,
            ttft_s=_median([q.ttft_s for q in requests if q.ttft_s is not None]),
            tpot_s=_median([q.tpot_s for q in requests if q.tpot_s is not None]),
            engine_steps=statistics.mean(r.engine_steps for r in runs),
            mean_in_flight=statistics.mean(r.mean_in_flight for r in runs),
            full_batch_share=statistics.mean(r.full_batch_seconds / r.seconds for r in runs),
            graph_steps=statistics.mean(r.graph_steps for r in runs),
            draft_graph_steps=statistics.mean(r.draft_graph_steps for r in runs),
        )


def merged_stats(runs: list[Run]) -> SpecStats:
    """The engine's speculation counters summed over ``runs`` (totals, not per run)."""
    stats = SpecStats()
    for r in runs:
        stats.merge(r.stats)
    return stats


def first_difference(out: list[int], ref: list[int]) -> int | None:
    """The first index where both hold a token and the tokens differ (None: one is a
    prefix of the other)."""
    return next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)


def compare(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, int | None]:
    """(requests equal to the reference, smallest index where any differs)."""
    same, first = 0, None
    for out, ref in zip(outputs, reference, strict=True):
        if out == ref:
            same += 1
            continue
        at = first_difference(out, ref)
        at = min(len(out), len(ref)) if at is None else at
        first = at if first is None else min(first, at)
    return same, first


@dataclass
class Agreement:
    """Greedy outputs against a reference, request by request, over every timed run."""

    identical: int = 0
    compared: int = 0
    first_mismatch_at: int | None = None  # smallest output index where one differs

    @classmethod
    def of(cls, runs: list[Run], reference: list[list[int]]) -> Agreement:
        agreement = cls()
        for r in runs:
            same, first = compare(r.token_ids, reference)
            agreement.identical += same
            agreement.compared += len(r.requests)
            if first is not None and (
                agreement.first_mismatch_at is None or first < agreement.first_mismatch_at
            ):
                agreement.first_mismatch_at = first
        return agreement

    @property
    def note(self) -> str:
        if self.identical == self.compared:
            return ""
        return f"MISMATCH from token {self.first_mismatch_at}"


@dataclass
class PromptCounts:
    """One prompt's speculation counters summed over the timed runs (``RequestMetrics``)."""

    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float | None:
        """1 + accepted / steps; None when the prompt never had a draft."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else None


def per_prompt_counts(runs: list[Run], num_prompts: int | None = None) -> list[PromptCounts]:
    """Per prompt, in prompt order; request ``j`` of a run is prompt ``j mod num_prompts``
    (default: one request per prompt; ``BenchConfig.waves`` cycles them). Invariant:
    summed over prompts, steps / drafted / accepted equal ``merged_stats(runs)``'s."""
    counts = [PromptCounts() for _ in range(num_prompts or len(runs[0].requests))]
    for r in runs:
        for j, q in enumerate(r.requests):
            c = counts[j % len(counts)]
            c.steps += q.spec_steps
            c.drafted_tokens += q.spec_drafted
            c.accepted_tokens += q.spec_accepted
            if q.ttft_s is not None:
                c.ttft_s.append(q.ttft_s)
            if q.tpot_s is not None:
                c.tpot_s.append(q.tpot_s)
    return counts
