"""Pushing a list of prompts through an engine: the one request loop every measurement,
trace and analysis pass uses.

``drive`` submits prompts in order and keeps at most ``concurrency`` of them unfinished,
adding the next prompt as soon as one finishes (what a client holding ``concurrency``
connections does); ``concurrency=None`` submits them all at once. ``generate`` times a
whole drive: from submitting the first request to the last one finishing, prefill
included, with the device synchronised at both ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from specdec.bench.env import synchronize
from specdec.engine.llm import LLM
from specdec.engine.llm_engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import RequestOutputKind, SamplingParams
from specdec.spec.metrics import SpecStats


@dataclass(frozen=True)
class RunParams:
    """Greedy generation of up to ``max_tokens`` per prompt (exactly that many with
    ``ignore_eos``), at most ``concurrency`` requests in flight (None: all at once)."""

    max_tokens: int
    ignore_eos: bool = False
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")

    def sampling(self, **overrides) -> SamplingParams:
        kwargs = dict(
            temperature=0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            output_kind=RequestOutputKind.FINAL_ONLY,  # as LLM.generate runs requests
        )
        return SamplingParams(**{**kwargs, **overrides})


@dataclass
class RequestRecord:
    """One request's outcome, from its final ``RequestOutput``. Times in seconds:
    TTFT = first token - arrival; TPOT = (finished - first token) / (tokens - 1)."""

    output_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None
    tpot_s: float | None  # None with fewer than two output tokens
    spec_steps: int  # verify steps with a draft (RequestMetrics)
    spec_drafted: int
    spec_accepted: int

    @classmethod
    def from_output(cls, out: RequestOutput) -> RequestRecord:
        m, ids = out.metrics, list(out.outputs[0].token_ids)
        ttft = tpot = None
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            if m.finished_time is not None and len(ids) > 1:
                tpot = (m.finished_time - m.first_token_time) / (len(ids) - 1)
        return cls(
            output_ids=ids,
            finish_reason=out.outputs[0].finish_reason,
            ttft_s=ttft,
            tpot_s=tpot,
            spec_steps=m.spec_steps,
            spec_drafted=m.spec_drafted_tokens,
            spec_accepted=m.spec_accepted_tokens,
        )


@dataclass
class Run:
    """One timed drive. Invariant: ``stats`` counts exactly the verify steps of these
    requests, so its totals equal the sums of the per-request spec fields."""

    seconds: float
    requests: list[RequestRecord]  # in submission order (the prompts, cycled with waves)
    stats: SpecStats = field(default_factory=SpecStats)
    engine_steps: int = 0  # engine.step() calls
    # Requests submitted and unfinished per engine step, averaged over the drive's steps: a
    # batch that drains as its requests finish runs below its concurrency (BenchConfig.waves).
    mean_in_flight: float = 0.0
    full_batch_seconds: float = 0.0  # wall time of steps run with every slot of the batch taken
    graph_steps: int = 0  # of those, target forwards replayed from a CUDA graph
    draft_graph_steps: int = 0  # proposals replayed from the proposer's CUDA graphs

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def token_ids(self) -> list[list[int]]:
        return [r.output_ids for r in self.requests]


def drive(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int | None = None,
    in_flight_log: list[tuple[int, float]] | None = None,
) -> Iterator[tuple[int, RequestOutput]]:
    """(prompt index, output) for every output the engine returns, per ``params``'s
    output kind. Requests still in flight when the caller stops are aborted.
    ``in_flight_log`` gets, at each engine step, the number of requests in flight and the
    ``time.perf_counter()`` at which the step was asked for."""
    limit = len(prompts) if concurrency is None else concurrency
    index: dict[str, int] = {}
    pending = iter(enumerate(prompts))
    in_flight = 0
    try:
        while True:
            while in_flight < limit:
                nxt = next(pending, None)
                if nxt is None:
                    break
                index[engine.add_request(nxt[1], params)] = nxt[0]
                in_flight += 1
            if not engine.has_unfinished_requests():
                return
            if in_flight_log is not None:
                in_flight_log.append((in_flight, time.perf_counter()))
            for out in engine.step():
                i = index.get(out.request_id)
                if i is None:  # someone else's request sharing the engine
                    continue
                if out.finished:
                    del index[out.request_id]
                    in_flight -= 1
                yield i, out
    finally:
        for request_id in index:
            engine.abort_request(request_id)


def generate(llm: LLM, prompts: list[list[int]], run: RunParams) -> Run:
    """Time one greedy drive over ``prompts``; speculation counters are reset first."""
    engine = llm.engine
    engine.spec_stats = SpecStats()
    steps0 = engine.num_steps
    replays0, draft_replays0 = graph_replays(engine), draft_graph_replays(engine)
    records: list[RequestRecord | None] = [None] * len(prompts)
    synchronize(engine.runner.device)
    steps: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    for i, out in drive(engine, prompts, run.sampling(), run.concurrency, steps):
        if out.finished:
            records[i] = RequestRecord.from_output(out)
    synchronize(engine.runner.device)
    t1 = time.perf_counter()
    seconds = t1 - t0
    assert all(r is not None for r in records), "a request never finished"
    in_flight = [n for n, _ in steps]
    full = min(len(prompts), run.concurrency or len(prompts))
    ends = [t for _, t in steps[1:]] + [t1]
    return Run(
        seconds=seconds,
        requests=records,  # type: ignore[arg-type]
        stats=engine.spec_stats,
        engine_steps=engine.num_steps - steps0,
        mean_in_flight=sum(in_flight) / len(in_flight) if in_flight else 0.0,
        full_batch_seconds=sum(
            end - start for (n, start), end in zip(steps, ends, strict=True) if n == full
        ),
        graph_steps=graph_replays(engine) - replays0,
        draft_graph_steps=draft_graph_replays(engine) - draft_replays0,
    )


def graph_replays(engine: LLMEngine) -> int:
    """Target forwards replayed from CUDA graphs so far (0 without graphs)."""
    return engine.num_graph_steps


def draft_graph_replays(engine: LLMEngine) -> int:
    """Whole proposals replayed from a model proposer's growth graphs so far."""
    grower = getattr(engine.proposer, "grower", None)
    return grower.num_replays if grower is not None else 0
