"""The API side under steady closed-loop load, with the GPU out of the picture (CPU).

At high concurrency ``specdec serve`` loses batch occupancy rather than step time: a
closed-loop client's next request is outside the batch from the moment its previous one
finishes until the engine admits it, and the API process's event loop, busy streaming
every running request's chunks, stretches that time. This script measures it with the
real app (``build_app``), the real engine core process and ``bench-serve``'s client around
a stand-in engine (``serve_core_intake.BusyEngine``: each step emits one token per running
request, spends ``--busy-ms`` in Python and then ``--wait-ms`` with the interpreter lock
released, as a GPU step's wait does), at each ``--concurrency``, ``--waves`` × c requests
of ``--max-tokens`` tokens per run.

Per run: output tok/s; the engine's occupancy (tokens per step ÷ c: 1.0 means every slot
decoded every step); TTFT at the server split into its phases (``/metrics``); the part
of a request's cycle spent outside the server (``client``: its slot's cycle time, c ×
duration ÷ completed, less the server's arrival-to-finish time); and the API process's
CPU (cores). Variants ``LABEL=JSON`` set ``ServeConfig`` fields, and uvicorn's ``loop``
(asyncio | uvloop) and ``http`` (h11 | httptools), e.g. ``--variants
'h11={"loop": "asyncio", "http": "h11"}' 'uv={"loop": "uvloop", "http": "httptools"}'``;
their runs interleave, so the host's drift spreads over all of them.

    python benchmarks/serve_api_steady.py --prompts writingbench100.jsonl \\
        --concurrency 16,64 --variants 'base={}' --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_core_intake import build as build_busy_engine
from serve_load import (
    bench_serve,
    client_ms,
    engine_steps,
    free_port,
    latency_sums,
    thread_cpu,
    ttft_split_ms,
    wait_health,
)

TOKEN_ID = 1000  # a plain word piece: every step's token shows as text


def serve(args) -> None:
    """The server side (``--serve PORT``): the real app around the stand-in core."""
    import uvicorn

    from specdec.models.loader import load_tokenizer
    from specdec.serve.app import build_app, http_stack
    from specdec.serve.async_engine import AsyncLLMEngine
    from specdec.serve.config import ServeConfig
    from specdec.serve.core_client import ProcCoreClient

    fields = json.loads(args.config)
    # uvicorn's event loop and HTTP parser; by default those `specdec serve` runs on.
    default_loop, default_http = http_stack()
    loop, http = fields.pop("loop", default_loop), fields.pop("http", default_http)
    config = ServeConfig(log_level="warning", **fields)
    busy = {"busy_s": args.busy_ms / 1e3, "wait_s": args.wait_ms / 1e3, "token_id": TOKEN_ID}
    core = ProcCoreClient(busy, build_engine=build_busy_engine, start_timeout=120)
    engine = AsyncLLMEngine(core, config.max_in_flight, load_tokenizer(args.model))
    app = build_app(engine, config)
    uvicorn.run(app, host="127.0.0.1", port=args.serve, log_level="warning", loop=loop, http=http)


def generation_tokens(url: str) -> float:
    from specdec.serve.spec_metrics import parse_exposition

    samples = parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text)
    return samples.get("specdec_generation_tokens_total", [({}, 0.0)])[0][1]


def one_run(args, url: str, pid: int, c: int, work: Path) -> dict:
    before = (latency_sums(url), engine_steps(url)[0], generation_tokens(url))
    cpu_before = thread_cpu(pid)
    report = bench_serve(url, args, c, work / f"c{c}.json")
    cpu_after = thread_cpu(pid)
    lat, steps, tokens = before
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed: {report.get('errors')}")
    split = ttft_split_ms(lat, latency_sums(url))
    n_steps = engine_steps(url)[0] - steps
    n_tokens = generation_tokens(url) - tokens
    api = sum(v for k, v in cpu_after.items() if k.startswith("api:")) - sum(
        v for k, v in cpu_before.items() if k.startswith("api:")
    )
    return {
        "tok_s": report["output_throughput"],
        "occupancy": n_tokens / n_steps / c if n_steps else 0.0,
        "ttft": split["ttft"],
        "prepare": split["prepare"],
        "queue": split["queue"],
        "rest": split["rest"],
        "client": client_ms(c, report, split),
        "tpot_p50": report["tpot_ms"]["p50"],
        "api_cores": api / report["duration_s"],
    }


def start_server(args, config: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--config", config,
           "--busy-ms", str(args.busy_ms), "--wait-ms", str(args.wait_ms),
           "--model", args.model]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, 300)
    except BaseException:
        proc.terminate()
        raise
    return proc, url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", help="JSONL of {messages} (specdec bench --export-prompts)")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--variants", nargs="+", default=["base={}"], help="LABEL=JSON")
    p.add_argument("--waves", type=int, default=4, help="requests per run: waves x c")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--busy-ms", type=float, default=0.5, help="the stand-in step's Python")
    p.add_argument("--wait-ms", type=float, default=2.2, help="the stand-in step's GPU wait")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--client-concurrency", type=int, default=32, help="streams per client")
    p.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer")
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server side
    p.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    if args.prompts is None:
        raise SystemExit("--prompts is required (specdec bench --export-prompts DIR)")
    variants = {}
    for item in args.variants:
        label, sep, config = item.partition("=")
        if not sep:
            raise SystemExit(f"--variants: {item!r} is not LABEL=JSON")
        json.loads(config)  # a bad variant fails before any server starts
        variants[label] = config
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for label, config in variants.items():
                proc, url = start_server(args, config)
                try:
                    warm = argparse.Namespace(**{**vars(args), "waves": 1, "max_tokens": 8})
                    bench_serve(url, warm, max(concurrency), work / "warm.json")
                    for c in concurrency:
                        time.sleep(0.5)
                        row = one_run(args, url, proc.pid, c, work)
                        rows.setdefault((c, label), []).append(row)
                        print(f"repeat {repeat} {label} c={c}: {json.dumps(row)}", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(30)
    if args.json:
        args.json.write_text(json.dumps({f"{c}/{v}": r for (c, v), r in rows.items()}, indent=1))
    keys = ("tok_s", "occupancy", "ttft", "prepare", "queue", "rest", "client", "api_cores")
    print(f"\nstand-in step {args.busy_ms} ms Python + {args.wait_ms} ms wait, "
          f"{args.max_tokens} tokens, {args.waves} x c requests a run; medians of "
          f"{args.repeats} runs (ms unless named)")  # fmt: skip
    print(
        "| c | variant | tok/s | occupancy | TTFT | prepare | queue | rest | client | API cores |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (c, label), runs in sorted(rows.items()):
        cells = []
        for key in keys:
            values = [r[key] for r in runs if r[key] is not None]
            value = statistics.median(values) if values else float("nan")
            cells.append(f"{value:.2f}" if key in ("occupancy", "api_cores") else f"{value:.0f}"
                         if key == "tok_s" else f"{value:.1f}")  # fmt: skip
        print(f"| {c} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
