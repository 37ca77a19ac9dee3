"""Time to first token of a burst of chat arrivals at the API side alone, per HTTP stack.

``specdec serve``'s API process parses each request (uvicorn's HTTP parser: h11, pure
Python, or httptools), validates it, renders and encodes its chat and sends it to the
engine core, and its event loop (asyncio's own, or uvloop) streams every running request's
chunks meanwhile. This script measures what that costs a burst of arrivals, with the GPU
out of the picture: the real app (``build_app``) and the real engine core process around
a stand-in engine (``serve_core_intake.BusyEngine``: each step emits one token per request
and spends ``--step-ms`` in Python), SmolLM2's tokenizer, and ``--burst`` WritingBench
chats sent at once by ``specdec bench-serve``'s client. It reports the client's TTFT
(mean, p50, p99) and the burst's wall time, medians over ``--repeats`` bursts, for each
``--variants`` entry ``LOOP/HTTP[/WORKERSxMAX_BATCH]`` (LOOP: asyncio | uvloop; HTTP:
h11 | httptools; the prompt encoder's shape, default the server's).

    python benchmarks/serve_api_burst.py --prompts writingbench100.jsonl --burst 64 \\
        --variants asyncio/h11,uvloop/httptools,uvloop/httptools/1x256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_core_intake import build as build_busy_engine
from serve_load import free_port, wait_health
from serve_prompt_encoding import parse_shapes

from specdec.serve.bench import BenchConfig, run_benchmark

TOKEN_ID = 1000  # a plain word piece: every step's token shows as text
LOOPS, HTTP_PARSERS = ("asyncio", "uvloop"), ("h11", "httptools")


def serve(args) -> None:
    """The server side (``--serve PORT``): the real app around the stand-in core."""
    import uvicorn

    from specdec.models.loader import load_tokenizer
    from specdec.serve.app import build_app
    from specdec.serve.async_engine import AsyncLLMEngine
    from specdec.serve.config import ServeConfig
    from specdec.serve.core_client import ProcCoreClient

    # No --encoder: the server's own default shape.
    workers, batch = parse_shapes(args.encoder)[0] if args.encoder else (None, None)
    config = ServeConfig(tokenizer_workers=workers, tokenizer_max_batch=batch, log_level="warning")
    busy = {"busy_s": args.step_ms / 1e3, "token_id": TOKEN_ID}
    core = ProcCoreClient(busy, build_engine=build_busy_engine, start_timeout=120)
    engine = AsyncLLMEngine(core, config.max_in_flight, load_tokenizer(args.model))
    app = build_app(engine, config)
    uvicorn.run(app, host="127.0.0.1", port=args.serve, log_level="warning",
                loop=args.loop, http=args.http)  # fmt: skip


def parse_variant(text: str) -> tuple[str, str, str | None]:
    """``LOOP/HTTP[/WORKERSxMAX_BATCH]`` -> (loop, http, encoder or None)."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or parts[0] not in LOOPS or parts[1] not in HTTP_PARSERS:
        raise SystemExit(
            f"--variants: {text!r} is not LOOP/HTTP[/WORKERSxMAX_BATCH] "
            f"(LOOP in {LOOPS}, HTTP in {HTTP_PARSERS})"
        )
    encoder = parts[2] if len(parts) == 3 else None
    if encoder:
        parse_shapes(encoder)  # a bad shape fails here, not in the server
    return parts[0], parts[1], encoder


def measure(args, variant: str, prompts: list[str]) -> dict:
    loop, http, encoder = parse_variant(variant)
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--loop", loop, "--http", http,
           *(["--encoder", encoder] if encoder else []),
           "--step-ms", str(args.step_ms), "--model", args.model]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, 300)
        config = BenchConfig(base_url=url, prompts=prompts, num_prompts=args.burst,
                             concurrency=args.burst, max_tokens=args.max_tokens)  # fmt: skip
        asyncio.run(run_benchmark(config))  # warm-up: connections, threads, caches
        runs = []
        for _ in range(args.repeats):
            time.sleep(0.2)
            report = asyncio.run(run_benchmark(config))
            if report["failed"]:
                raise RuntimeError(f"{variant}: {report['failed']} requests failed")
            runs.append(report)
    finally:
        proc.terminate()
        proc.wait(30)

    def med(get) -> float:
        return statistics.median(get(r) for r in runs)

    return {
        "ttft_mean_ms": med(lambda r: r["ttft_ms"]["mean"]),
        "ttft_p50_ms": med(lambda r: r["ttft_ms"]["p50"]),
        "ttft_p99_ms": med(lambda r: r["ttft_ms"]["p99"]),
        "burst_s": med(lambda r: r["duration_s"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, help="JSONL of {messages} (one user turn each)")
    p.add_argument(
        "--variants", default="asyncio/h11,uvloop/h11,asyncio/httptools,uvloop/httptools"
    )
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=2.5, help="the stand-in engine's step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer")
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server side
    p.add_argument("--loop", help=argparse.SUPPRESS)
    p.add_argument("--http", help=argparse.SUPPRESS)
    p.add_argument("--encoder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    if args.prompts is None:
        raise SystemExit(
            "--prompts is required (a JSONL of chats, e.g. specdec bench --export-prompts)"
        )
    for variant in args.variants.split(","):
        parse_variant(variant)  # every variant checked before the first server starts
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["messages"][-1]["content"] for r in rows][: args.burst]
    results = {v: measure(args, v, prompts) for v in args.variants.split(",")}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\n{args.burst} chats at once, {args.max_tokens} tokens each, a {args.step_ms} ms "
          "stand-in step; client TTFT (ms) and the burst's wall time, medians of "
          f"{args.repeats} bursts")  # fmt: skip
    print("| loop / HTTP / encoder | TTFT mean | p50 | p99 | burst s |")
    print("|---|---:|---:|---:|---:|")
    for v, r in results.items():
        print(f"| {v} | {r['ttft_mean_ms']:.1f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['burst_s']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
