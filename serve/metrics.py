"""Prometheus metrics for /metrics, on a registry owned by the server (no global state).

Request metrics are observed on the event loop when a request finishes; engine metrics are
read at scrape time from the engine core's latest ``EngineSnapshot``. Names (all
``specdec_`` prefixed; counters get ``_total`` appended by the exposition format):

- ``num_requests_running`` / ``num_requests_waiting``: the scheduler's queues.
- ``kv_cache_usage_perc``: fraction (0..1) of usable KV blocks held by requests;
  ``kv_cache_free_blocks`` / ``kv_cache_total_blocks``: the pool in blocks.
- ``prefix_cache_queries`` / ``prefix_cache_hits`` (blocks) and ``prefix_cache_hit_rate``.
- ``engine_steps`` and ``engine_graph_steps``: steps run, and target forwards replayed from
  a CUDA graph; the difference ran eagerly (several times slower for a decode batch), so
  a server stepping more eagerly than the offline engine on the same load shows it here.
- ``request_success{finished_reason}``, ``request_aborted``, ``request_rejected{reason}``,
  ``prompt_tokens``, ``generation_tokens``: request counters (aborts include their
  tokens generated before the abort).
- ``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
  ``e2e_request_latency_seconds``: histograms measured from the request's arrival at the
  server; TPOT = (e2e - TTFT) / (output tokens - 1), for requests with >= 2 tokens.
- Where a request's time to first token went, from the engine core's timeline of each
  finished request: ``request_prepare_time_seconds`` (arrival at the server until the API
  side sends the request to the engine core: validation, chat template, the prompt's
  encoding), ``request_queue_time_seconds`` (sent until a step first admits it: the
  channel, the step the core loop was running, the scheduler's queue) and
  ``request_prefill_time_seconds`` (first admitted to first token: its prefill steps,
  chunks and any wait beside other requests' work); ``request_decode_time_seconds``
  covers first token to finish in the core. Prepare + queue + prefill <= TTFT per
  request; the rest of TTFT is the first token's way back to the request's stream.
- ``spec_decode_num_steps`` / ``spec_decode_num_draft_tokens`` /
  ``spec_decode_num_accepted_tokens``: a *step* is one target verification forward for
  one request with a draft; ``spec_decode_mean_acceptance_length`` is τ = 1 +
  accepted / steps (bonus token included); ``spec_decode_acceptance_rate{position="k"}``
  is a_k, the fraction of steps that accepted at least k draft tokens.
- ``spec_decode_graphs_pending``: 1 while speculation's deferred CUDA graphs are being
  captured after start-up (``--defer-graphs``; steps decode plainly), else 0.
- ``deferred_graphs_pending``: 1 while any deferred CUDA graph remains, speculation's or
  those of steps wider than start-up captured (each capture holds the engine between two
  steps), else 0: the server runs at full speed once it reads 0.
- ``spec_exit_requests`` / ``spec_exit_triggered`` / ``spec_exit_think_tokens_saved``:
  SpecExit (docs/spec_exit.md): requests that opted in, exits triggered (thinking cut
  short), and the think tokens saved as the draft head estimated them (its remaining
  signal at each exit; an estimate, not a count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specdec.serve.async_engine import RequestStats
from specdec.serve.engine_core import EngineSnapshot

PREFIX = "specdec_"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_PHASE_BUCKETS = (0.001, 0.0025, *_LATENCY_BUCKETS)  # prepare and queue: often milliseconds
_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield _gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of usable KV blocks held by requests.", s.kv_usage
        )
        yield _gauge("kv_cache_free_blocks", "Free KV blocks.", s.kv_free_blocks)
        yield _gauge("kv_cache_total_blocks", "Usable KV blocks.", s.kv_total_blocks)
        yield _counter(
            "prefix_cache_queries",
            "KV blocks looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield _counter(
            "prefix_cache_hits", "KV blocks found in the prefix cache.", s.prefix_cache_hits
        )
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield _gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (blocks).", rate)
        yield _counter("engine_steps", "Engine steps run.", s.num_steps)
        yield _counter(
            "engine_graph_steps",
            "Target forwards replayed from a CUDA graph (the rest of the steps ran eagerly).",
            s.num_graph_steps,
        )
        yield _counter(
            "num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions
        )
        yield _counter(
            "spec_decode_num_steps", "Verify steps of one request with a draft.", s.spec_steps
        )
        yield _counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_drafted_tokens
        )
        yield _counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens
        )
        tau = 1.0 + s.spec_accepted_tokens / s.spec_steps if s.spec_steps else 0.0
        yield _gauge(
            "spec_decode_mean_acceptance_length",
            "tau: tokens emitted per verify step, bonus included (0 before any step).",
            tau,
        )
        rates = GaugeMetricFamily(
            PREFIX + "spec_decode_acceptance_rate",
            "a_k: fraction of verify steps accepting at least k draft tokens.",
            labels=["position"],
        )
        for k in range(1, s.spec_depth + 1):
            hits = s.spec_accepted_at_least[k - 1] if k <= len(s.spec_accepted_at_least) else 0
            rates.add_metric([str(k)], hits / s.spec_steps if s.spec_steps else 0.0)
        yield rates
        yield _gauge(
            "spec_decode_graphs_pending",
            "1 while speculation's deferred CUDA graphs are being captured (plain steps).",
            float(s.spec_graphs_pending),
        )
        yield _gauge(
            "deferred_graphs_pending",
            "1 while any deferred CUDA graph remains to capture (between steps).",
            float(s.graphs_pending),
        )
        yield _counter(
            "spec_exit_requests", "Requests that opted into SpecExit.", s.spec_exit_requests
        )
        yield _counter(
            "spec_exit_triggered", "SpecExit exits (thinking cut short).", s.spec_exit_exits
        )
        yield _counter(
            "spec_exit_think_tokens_saved",
            "Think tokens saved by SpecExit, as the draft head estimated at each exit.",
            s.spec_exit_tokens_saved,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """The server's registry: request metrics it observes plus the engine collector."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean seconds per output token after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from arrival to the last output token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        phases = {
            "prepare": "arrival at the server to its send to the engine core",
            "queue": "its send to the engine core to the first step admitting it",
            "prefill": "first step to first token, in the engine core",
            "decode": "first token to finish, in the engine core",
        }
        self.phases = {
            name: Histogram(
                f"{PREFIX}request_{name}_time_seconds",
                f"Seconds from {span}.",
                buckets=_PHASE_BUCKETS,
                registry=r,
            )
            for name, span in phases.items()
        }
        self.success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length"):
            self.success.labels(reason)
        self.aborted = Counter(
            PREFIX + "request_aborted", "Requests aborted (client gone).", registry=r
        )
        self.rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused before generation, by reason.",
            ["reason"],
            registry=r,
        )
        self.rejected.labels("queue_full")
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Output tokens generated.", registry=r
        )
        r.register(_EngineCollector(snapshot))

    def observe_finished(self, stats: RequestStats) -> None:
        """A request left the engine (finished or aborted): count it and its latencies."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_output_tokens)
        if stats.finish_reason == "abort":
            self.aborted.inc()
            return
        self.success.labels(stats.finish_reason).inc()
        if stats.first_token_time is None or stats.finished_time is None:
            return
        ttft = stats.first_token_time - stats.arrival_time
        e2e = stats.finished_time - stats.arrival_time
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if stats.num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (stats.num_output_tokens - 1))
        core = stats.core
        if core is None or core.first_scheduled_time is None or core.first_token_time is None:
            return  # finished at the server (a stop string) before the core reported
        self.phases["prepare"].observe(core.arrival_time - stats.arrival_time)
        self.phases["queue"].observe(core.first_scheduled_time - core.arrival_time)
        self.phases["prefill"].observe(core.first_token_time - core.first_scheduled_time)
        if core.finished_time is not None:
            self.phases["decode"].observe(core.finished_time - core.first_token_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
