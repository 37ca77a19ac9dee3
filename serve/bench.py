"""``specdec bench-serve``: load a running OpenAI-compatible server and report latency.

Like vLLM's serving benchmark: requests are sent at ``request_rate`` per second (Poisson
arrivals: exponential gaps; ``inf`` sends them all at once), with at most ``concurrency``
in flight, each streaming its answer. Per request it records TTFT (send → first text),
TPOT ((e2e − TTFT) / (output tokens − 1)), the gaps between chunks (ITL; with speculation a
chunk may hold several tokens) and end-to-end latency; output tokens come from the final
usage chunk. The report has throughput and mean/p50/p90/p99 of each latency, in ms, and
the server's τ and per-position acceptance over the run when its /metrics has speculation
counters: specdec's own server or vLLM's (``spec_metrics.METRICS_SOURCES``), scraped before
and after the run and reported in one form.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from specdec.serve.spec_metrics import METRICS_SOURCES, SpecCounters, read_counters

# The report's schema tag: ``specdec.bench.analysis.load_report`` reads these reports too
# (τ and per-position acceptance of a served model, specdec's or vLLM's).
SERVE_SCHEMA = "specdec.bench-serve/1"

DEFAULT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for writing clear technical documentation.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "List five fruits and one fact about each.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Describe how a hash map works to a new programmer.",
]


@dataclass
class BenchConfig:
    """One benchmark run. ``concurrency`` None means unbounded; ``request_rate`` is
    requests per second (``inf``: all at once)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"  # "chat" | "completions"
    model: str | None = None  # None: the server's first model
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    num_prompts: int = 100
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    concurrency: int | None = None
    request_rate: float = float("inf")
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    metrics_source: str = "auto"  # "auto" or a METRICS_SOURCES name (specdec, vllm)

    def __post_init__(self) -> None:
        if self.metrics_source != "auto" and self.metrics_source not in METRICS_SOURCES:
            raise ValueError(
                f"metrics_source={self.metrics_source!r}; choose auto or one of "
                f"{sorted(METRICS_SOURCES)}"
            )
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint={self.endpoint!r}; choose chat or completions")
        if not self.prompts:
            raise ValueError("no prompts; pass a non-empty prompts file or use the defaults")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1 (or unset)")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} must be > 0 (inf: all at once)")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str = ""


async def run_benchmark(config: BenchConfig) -> dict:
    """Send the requests; return the report (see ``summarize``)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.timeout_s, connect=30.0)
    connector = aiohttp.TCPConnector(limit=config.concurrency or config.num_prompts)
    # aiohttp's C parser: a client parsing thousands of SSE events a second must not be
    # the limit it measures (httpx's pure-Python stack was, at 32 streams a process).
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector, read_bufsize=_READ_BUFSIZE
    ) as client:
        base = config.base_url.rstrip("/")
        model = config.model or await _first_model(client, base)
        counters_before = await _spec_counters(client, base, config.metrics_source)
        rng = random.Random(config.seed)
        gate = asyncio.Semaphore(config.concurrency or config.num_prompts)
        prompts = [config.prompts[i % len(config.prompts)] for i in range(config.num_prompts)]

        async def one(prompt: str) -> RequestResult:
            async with gate:
                return await _send(client, base, config, model, prompt)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if config.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        counters_after = await _spec_counters(client, base, config.metrics_source)
    report = summarize(config, model, results, duration)
    if counters_before and counters_after and counters_before[0] == counters_after[0]:
        source, after = counters_after
        report["speculation"] = after.minus(counters_before[1]).report(source)
    return report


# The longest SSE line the client reads (aiohttp's line reader refuses longer ones): a chunk
# with top logprobs runs to kilobytes.
_READ_BUFSIZE = 1 << 20


async def _spec_counters(client, base: str, source: str) -> tuple[str, SpecCounters] | None:
    """The server's speculation counters from /metrics and whose names matched (None if
    it has none), so the report shows τ over exactly this run."""
    try:
        async with client.get(f"{base}/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except Exception:  # a server without /metrics still gets benchmarked
        return None
    try:
        return read_counters(text, source)
    except ValueError:  # not a Prometheus exposition
        return None


async def _first_model(client, base: str) -> str:
    async with client.get(f"{base}/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def _send(client, base: str, config: BenchConfig, model: str, prompt: str) -> RequestResult:
    body: dict = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    result = RequestResult(ok=False)
    sent = time.perf_counter()
    last = sent
    try:
        async with client.post(base + path, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            async for line in response.content:  # one SSE line at a time, b"\n" kept
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except Exception as e:  # a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - sent
    result.ok = True
    return result


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices", []):
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(config: BenchConfig, model: str, results: list[RequestResult], duration: float):
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    settings = {k: v for k, v in asdict(config).items() if k not in ("prompts", "api_key")}
    settings["request_rate"] = str(config.request_rate)  # JSON has no inf
    return {
        "schema": SERVE_SCHEMA,
        "model": model,
        "base_url": config.base_url,
        "settings": settings,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
    }


def format_report(report: dict) -> str:
    lines = [
        f"model {report['model']}: {report['completed']} completed, {report['failed']} failed "
        f"in {report['duration_s']:.2f} s",
        f"throughput: {report['request_throughput']:.2f} req/s, "
        f"{report['output_throughput']:.1f} output tokens/s "
        f"({report['total_input_tokens']} input, {report['total_output_tokens']} output tokens)",
    ]
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        s = report[key]
        lines.append(
            f"{label:>4} ms: mean {s['mean']:.1f}  p50 {s['p50']:.1f}  p90 {s['p90']:.1f}  "
            f"p99 {s['p99']:.1f}"
        )
    if report.get("speculation"):
        spec = report["speculation"]
        rates = ", ".join(f"{r:.2f}" for r in spec["acceptance_rates"][:8])
        lines.append(
            f"speculation ({spec['source']} metrics): τ={spec['tau']:.2f} over "
            f"{spec['steps']:.0f} verify steps ({spec['accepted_tokens']:.0f} of "
            f"{spec['drafted_tokens']:.0f} draft tokens accepted); per-position acceptance "
            f"[{rates}]"
        )
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
