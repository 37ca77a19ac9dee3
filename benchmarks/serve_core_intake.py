"""How long a burst of arrivals takes to reach a busy engine core (CPU).

``specdec serve`` runs the engine core in its own process (``serve/core_client.py``): the
API side queues add commands, the core's reader thread takes them off a pipe, and the core
applies them between steps. The core's loop holds its interpreter lock while it prepares a
step, so how commands travel decides how long a burst of arrivals waits while the core is
busy. This script runs the real ``ProcCoreClient`` and ``AsyncLLMEngine`` around a
stand-in engine whose every step spends ``--busy-ms`` in Python (one token per request per
step, nothing else), keeps one long request running, then adds ``--requests`` prompts of
``--prompt-len`` tokens at once and reports when the core accepted them (mean and last,
from the first add), median of ``--repeats`` bursts, per busy time.

    python benchmarks/serve_core_intake.py --busy-ms 1,2,5 --requests 64 --prompt-len 1200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from specdec.outputs import RequestMetrics, TokenDelta
from specdec.serve.async_engine import AsyncLLMEngine
from specdec.serve.core_client import ProcCoreClient
from specdec.spec.metrics import SpecStats


class BusyEngine:
    """An engine whose steps emit one token (``token_id``) per running request and spend ``busy_s``
    in Python, holding the interpreter lock as step preparation does, then ``wait_s`` with
    the lock released, as waiting for the GPU's step does. Each request's metrics carry
    its core timeline (arrival, first step, first token, finish)."""

    def __init__(self, busy_s: float, token_id: int = 0, wait_s: float = 0.0) -> None:
        self.busy_s, self.token_id, self.wait_s = busy_s, token_id, wait_s
        self.limits: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.metrics: dict[str, RequestMetrics] = {}
        self.num_steps = self.num_graph_steps = 0
        self.spec_stats, self.proposer = SpecStats(), None
        self.has_pending_graphs = self.speculation_graphs_pending = False
        self.resolved, self.max_model_len = "busy", 1 << 20
        self.config = SimpleNamespace(speculative=None)
        self.runner = SimpleNamespace(runtime=SimpleNamespace(device="cpu", dtype="float32"))
        pool = SimpleNamespace(num_usable_blocks=1, num_free_blocks=1, prefix_queries=0)
        pool.prefix_hits = 0
        self.kv_manager = SimpleNamespace(pool=pool)
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)

    def hook(self, kind):
        return None

    def add_request(self, prompt, params, request_id: str, arrival_time: float) -> str:
        self.limits[request_id], self.counts[request_id] = params.max_tokens, 0
        self.metrics[request_id] = RequestMetrics(arrival_time=arrival_time)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.limits.pop(request_id, None)
        self.metrics.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.limits)

    def step(self) -> list[TokenDelta]:
        self.num_steps += 1
        start = time.monotonic()
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:  # Python work: the lock stays with this thread
            sum(range(100))
        if self.wait_s:
            time.sleep(self.wait_s)  # the GPU's share: the lock released
        now = time.monotonic()
        outputs = []
        for request_id in list(self.limits):
            self.counts[request_id] += 1
            metrics = self.metrics[request_id]
            if metrics.first_token_time is None:
                metrics.first_scheduled_time, metrics.first_token_time = start, now
            done = self.counts[request_id] >= self.limits[request_id]
            if done:
                metrics.finished_time = now
                del self.limits[request_id], self.metrics[request_id]
            outputs.append(
                TokenDelta(
                    request_id,
                    [self.token_id],
                    None,
                    "length" if done else None,
                    None,
                    metrics if done else None,
                )
            )
        return outputs


def build(config: dict) -> BusyEngine:
    return BusyEngine(config["busy_s"], config.get("token_id", 0), config.get("wait_s", 0.0))


class Ids:
    """A tokenizer for ids that are never shown."""

    def decode(self, token_ids, skip_special_tokens=True, **kwargs) -> str:
        return "x" * len(token_ids)


async def bursts(busy_s: float, requests: int, prompt_len: int, repeats: int) -> list[dict]:
    from specdec.sampling_params import SamplingParams

    core = ProcCoreClient({"busy_s": busy_s}, build_engine=build, start_timeout=120)
    engine = AsyncLLMEngine(core, 4 * requests + 1, tokenizer=Ids())
    engine.start()
    try:
        await engine.add_request("long", [1], SamplingParams(max_tokens=1 << 30))
        prompt = list(range(1000, 1000 + prompt_len))
        rows = []
        for r in range(repeats):
            await asyncio.sleep(0.3)
            start, accepted = time.perf_counter(), []

            async def add(i: int, r: int = r, start: float = start, accepted: list = accepted):
                params = SamplingParams(max_tokens=1)
                stream = await engine.add_request(f"b{r}-{i}", prompt, params)
                accepted.append(time.perf_counter() - start)
                async for _ in stream:  # its one token: the request leaves the engine
                    pass

            await asyncio.gather(*(add(i) for i in range(requests)))
            mean, last = statistics.mean(accepted), max(accepted)
            rows.append({"mean_ms": 1e3 * mean, "last_ms": 1e3 * last})
        return rows
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--busy-ms",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[1.0, 2.0, 5.0],
        help="Python milliseconds per core step, comma-separated (at least 1: a core "
        "stepping faster streams more messages than the API side reads)",
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    rows = []
    for busy in a.busy_ms:
        if busy < 1:
            raise SystemExit(f"--busy-ms {busy} must be at least 1 (see --help)")
        runs = asyncio.run(bursts(busy / 1e3, a.requests, a.prompt_len, a.repeats))
        rows.append({
            "busy_ms": busy,
            "mean_ms": statistics.median(r["mean_ms"] for r in runs),
            "last_ms": statistics.median(r["last_ms"] for r in runs),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{a.requests} adds of {a.prompt_len} tokens at once, accepted by the core after (ms):")
    print("| core step, Python ms | mean | last |\n|---:|---:|---:|")
    for r in rows:
        print(f"| {r['busy_ms']} | {r['mean_ms']:.1f} | {r['last_ms']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
