"""`specdec serve` under load against the offline engine on the same prompts, in one run.

For each server variant (``--variants``: ``none`` = plain decoding, ``default`` = the
model's default speculation, i.e. its shipped head) it launches ``python -m specdec.serve``,
records the seconds until /health answers, until it speculates (its deferred speculation
graphs captured) and until every deferred graph is captured (those of wider steps follow
speculation's, each capture holding the engine between two steps), then runs ``specdec
bench-serve`` (a separate client process) at each concurrency, and samples the CPU time of
every thread of the server's processes while the largest concurrency runs (where the host
time goes: the event loop, the engine loop, the core's pipe threads; with ``--py-spy``,
py-spy's stacks too). Then ``specdec bench`` runs offline at the same batch sizes on the
same prompts (plain and default speculation, ``--waves``). The servers run with prefix
caching off, as the offline engine does: the runs cycle the same prompts (and the warm-up
sends the first of them), so a cache would skip prefills offline pays for.

    python benchmarks/serve_load.py --prompts wb.jsonl --concurrency 1,4,16,64,128 \
        --max-tokens 256 --json out.json [--server-args "--dtype bfloat16"]

A variant ``BASE@LABEL`` runs BASE's server with ``--variant-args LABEL=FLAGS`` added and
is compared with BASE's offline engine, e.g. two encoder shapes in one run:
``--variants none,none@w4 --variant-args "w4=--tokenizer-workers 4"``.

The tables printed last: output tok/s and TPOT p50 per (concurrency, variant) for the
server and the offline engine and the server's share of offline; the server's TTFT split
into its phases, beside the part of each closed-loop slot's cycle spent outside the server
(``client_ms``); each run's engine steps, the eager ones (no CUDA graph replayed) and
tokens per step beside the offline engine's; and each server's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx

VARIANT_ARGS = {"none": ["--draft", "none"], "default": []}


def variant_base(variant: str) -> str:
    """``none@LABEL`` -> ``none``: the offline engine a server variant is compared with."""
    base = variant.partition("@")[0]
    if base not in VARIANT_ARGS:
        raise SystemExit(
            f"--variants: {variant!r} must be BASE or BASE@LABEL, BASE in {list(VARIANT_ARGS)}"
        )
    return base


def parse_variant_args(items: list[str]) -> dict[str, list[str]]:
    """``LABEL=FLAGS`` entries -> {LABEL: [flags]}."""
    out = {}
    for item in items:
        label, sep, flags = item.partition("=")
        if not sep or not label:
            raise SystemExit(f"--variant-args: {item!r} is not LABEL=FLAGS")
        out[label] = shlex.split(flags)
    return out


SPEC_PENDING_METRIC = "specdec_spec_decode_graphs_pending"
GRAPHS_PENDING_METRIC = "specdec_deferred_graphs_pending"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread of ``pid`` and of its children."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    out: dict[str, float] = {}
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            # Python threads keep the process's name: tell them apart by id (main = pid).
            tid = "main" if task.name == str(p) else task.name
            key = f"{'api' if p == pid else 'core'}:{tid}:{name}"
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _stamp(stream, log: Path, start: float) -> None:
    with log.open("w") as f:
        for line in stream:
            f.write(f"{time.monotonic() - start:8.2f} {line}")
            f.flush()


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout} s")


def wait_metric_zero(
    url: str, proc: subprocess.Popen, start: float, timeout: float, metric: str
) -> float:
    """Seconds from launch until /metrics reads ``metric`` as 0 (or lacks it)."""
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        text = httpx.get(f"{url}/metrics", timeout=5).text
        pending = [ln for ln in text.splitlines() if ln.startswith(metric)]
        if not pending or float(pending[0].split()[-1]) == 0.0:
            return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"{metric} still 1 after {timeout} s")


def py_spy_record(py_spy: str, pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """py-spy samples every process of the server (the API process and the engine core)
    for ``seconds``, in collapsed-stack form (``summarize_stacks`` reads it)."""
    cmd = [py_spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking",
           "--rate", "200", "--duration", str(int(seconds)), "--format", "raw",
           "--output", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarize_stacks(path: Path, top: int = 25) -> list[tuple[float, str]]:
    """The frames holding the most samples in a collapsed-stack file, as (share of the
    samples of that process, "process | function (file:line)"), leaf frames (self time)."""
    per_process: dict[str, int] = {}
    leaves: dict[tuple[str, str], int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = frames[0] if frames[0].startswith("process") else "?"
        per_process[process] = per_process.get(process, 0) + int(count)
        key = (process, frames[-1])
        leaves[key] = leaves.get(key, 0) + int(count)
    ranked = sorted(leaves.items(), key=lambda kv: -kv[1])[:top]
    return [(n / per_process[proc], f"{proc[:60]} | {leaf}") for (proc, leaf), n in ranked]


TTFT_PHASES = ("prepare", "queue", "prefill")  # the server's request_<phase>_time_seconds


def engine_steps(url: str) -> tuple[float, float]:
    """(steps, steps replayed from a CUDA graph) the server's engine has run, from /metrics."""
    from specdec.serve.spec_metrics import parse_exposition

    samples = parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text)
    names = ("specdec_engine_steps_total", "specdec_engine_graph_steps_total")
    steps, graphs = (samples.get(n, [({}, 0.0)])[0][1] for n in names)
    return steps, graphs


def latency_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's TTFT and end-to-end histograms and of its TTFT phases,
    from /metrics."""
    from specdec.serve.spec_metrics import parse_exposition

    samples = parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text)
    names = {"ttft": "time_to_first_token", "e2e": "e2e_request_latency"} | {
        p: f"request_{p}_time" for p in TTFT_PHASES
    }
    out = {}
    for key, name in names.items():
        total = samples.get(f"specdec_{name}_seconds_sum", [({}, 0.0)])[0][1]
        count = samples.get(f"specdec_{name}_seconds_count", [({}, 0.0)])[0][1]
        out[key] = (total, count)
    return out


def ttft_split_ms(before: dict, after: dict) -> dict[str, float | None]:
    """Mean ms of TTFT, end-to-end and each phase over the requests finished between two
    ``latency_sums``; ``rest`` is TTFT less the phases: the first token's way back."""
    means: dict[str, float | None] = {}
    for key, (total, count) in after.items():
        n = count - before[key][1]
        means[key] = 1e3 * (total - before[key][0]) / n if n else None
    parts = [means[p] for p in TTFT_PHASES]
    ttft = means["ttft"]
    means["rest"] = None if ttft is None or None in parts else ttft - sum(parts)
    return means


def client_ms(c: int, report: dict, split: dict) -> float | None:
    """The part of a closed-loop slot's cycle spent outside the server, ms: the cycle (c ×
    duration ÷ completed) less the server's mean arrival-to-finish (``split["e2e"]``). The
    client's parsing of the last chunks, its next request's send and the server's HTTP
    intake before the handler; idle slots the offline engine does not have."""
    e2e = split.get("e2e")
    if e2e is None or not report["completed"]:
        return None
    return 1e3 * c * report["duration_s"] / report["completed"] - e2e


def bench_serve(url: str, args, c: int, out: Path) -> dict:
    """``specdec bench-serve`` at concurrency ``c``, split over one client process per
    ``--client-concurrency`` streams: one Python client parsing 128 SSE streams is
    slower than the server. Throughputs add up; latency percentiles are the clients'
    medians."""
    k = max(1, -(-c // args.client_concurrency))
    total = max(16, args.waves * c)
    procs, files = [], []
    for i in range(k):
        share_c, share_n = c // k + (i < c % k), total // k + (i < total % k)
        files.append(out.with_name(f"{out.stem}_{i}.json"))
        cmd = [
            sys.executable, "-m", "specdec.cli", "bench-serve", "--base-url", url,
            "--prompts-file", args.prompts, "--num-prompts", str(share_n),
            "--max-tokens", str(args.max_tokens), "--ignore-eos", "--concurrency", str(share_c),
            "--seed", str(i), "--json", str(files[-1]),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"bench-serve exited with {proc.returncode}")
    merged = merge_client_reports([json.loads(f.read_text()) for f in files])
    out.write_text(json.dumps(merged, indent=1))
    return merged


def merge_client_reports(reports: list[dict]) -> dict:
    """One report of several ``bench-serve`` clients run at once: counts, tokens and
    throughputs summed, the longest duration, latency p50s as the clients' medians."""
    merged = dict(reports[0])
    for key in ("output_throughput", "completed", "failed", "total_input_tokens",
                "total_output_tokens"):  # fmt: skip
        merged[key] = sum(r[key] for r in reports)
    merged["duration_s"] = max(r["duration_s"] for r in reports)
    for key in ("tpot_ms", "ttft_ms"):
        merged[key] = {"p50": statistics.median(r[key]["p50"] for r in reports)}
    merged["clients"] = len(reports)
    return merged


def run_server(variant: str, args, work: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"serve_{variant}.log"
    label = variant.partition("@")[2]
    if label and label not in args.variant_args:
        raise SystemExit(
            f"--variants: {variant!r} names {label!r}; add --variant-args {label}=FLAGS"
        )
    cmd = [sys.executable, "-m", "specdec.serve", "--port", str(port),
           *VARIANT_ARGS[variant_base(variant)],
           *([] if args.prefix_caching else ["--no-enable-prefix-caching"]),
           *shlex.split(args.server_args), *args.variant_args.get(label, [])]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Each log line stamped with seconds since launch: the start-up's timeline.
    stamper = threading.Thread(target=_stamp, args=(proc.stdout, log, start), daemon=True)
    stamper.start()
    result: dict = {"variant": variant, "rows": {}, "log": str(log)}
    try:
        result["health_s"] = wait_health(url, proc, args.start_timeout)
        print(f"[{variant}] healthy after {result['health_s']:.1f} s", flush=True)
        # Speculation starts once its graphs are captured (steps decode plainly until
        # then); the graphs of wider steps follow, each capture holding the engine between
        # two steps: the runs start when none remains, as a server warmed up serves.
        wait = partial(wait_metric_zero, url, proc, start, args.start_timeout)
        result["speculation_s"] = wait(SPEC_PENDING_METRIC)
        print(f"[{variant}] speculating {result['speculation_s']:.1f} s after launch", flush=True)
        result["graphs_s"] = wait(GRAPHS_PENDING_METRIC)
        print(f"[{variant}] every graph captured {result['graphs_s']:.1f} s in", flush=True)
        bench_serve(url, args, 1, work / "warm.json")  # first requests pay one-time costs
        top = max(args.concurrency)
        for c in args.concurrency:
            before = thread_cpu(proc.pid) if c == top else None
            spy = None
            if before is not None and args.py_spy:
                stacks = work / f"stacks_{variant}_c{c}.txt"
                spy = py_spy_record(args.py_spy, proc.pid, args.py_spy_s, stacks)
            sums, steps0 = latency_sums(url), engine_steps(url)
            t0 = time.monotonic()
            report = bench_serve(url, args, c, work / f"serve_{variant}_c{c}.json")
            split = ttft_split_ms(sums, latency_sums(url))
            steps1 = engine_steps(url)
            if spy is not None:
                spy.wait()
                result["stacks"] = str(stacks)
                result["top_frames"] = summarize_stacks(stacks)
            if before is not None:
                wall = time.monotonic() - t0
                after = thread_cpu(proc.pid)
                result["cpu_share"] = {
                    k: round((after[k] - before.get(k, 0.0)) / wall, 3)
                    for k in after
                    if after[k] - before.get(k, 0.0) > 0.01 * wall
                }
            result["rows"][c] = {
                "tok_s": report["output_throughput"],
                "tpot_p50_ms": report["tpot_ms"]["p50"],
                "ttft_p50_ms": report["ttft_ms"]["p50"],
                "ttft_split_ms": split,
                "client_ms": client_ms(c, report, split),
                "output_tokens": report["total_output_tokens"],
                "steps": steps1[0] - steps0[0],
                "graph_steps": steps1[1] - steps0[1],
                "tau": (report.get("speculation") or {}).get("tau"),
            }
            print(f"[{variant}] c={c}: {result['rows'][c]}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        result["total_s"] = time.monotonic() - start
    return result


def steps_cells(tokens: float | None, steps: float | None, graphs: float | None) -> list[str]:
    """The ``steps | eager | tokens per step`` table cells (blank where unknown)."""
    if not steps:
        return ["", "", ""]
    eager = "" if graphs is None else f"{steps - graphs:,.0f}"
    per_step = "" if tokens is None else f"{tokens / steps:.1f}"
    return [f"{steps:,.0f}", eager, per_step]


def run_offline(args, work: Path) -> dict:
    out = work / "offline.json"
    cmd = [
        sys.executable, "-m", "specdec.cli", "bench", "--prompts", args.prompts,
        "--num-prompts", "1000", "--batch-sizes", ",".join(map(str, args.concurrency)),
        "--max-tokens", str(args.max_tokens), "--ignore-eos", "--waves", str(args.waves),
        "--repeats", str(args.repeats), "--json", str(out), "--no-progress",
        *shlex.split(args.offline_args),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    rows = {}
    for row in json.loads(out.read_text())["rows"]:
        b = row["batch_size"]
        rows[b] = {
            "none": row["plain"]["tokens_per_s"] if row.get("plain") else None,
            "default": row["spec"]["tokens_per_s"] if row.get("spec") else None,
            "none_tpot_ms": 1e3 * (row["plain"].get("tpot_s") or 0) if row.get("plain") else None,
            "tau": row.get("tau"),
            # per variant: (output tokens, engine steps, steps replayed from a graph)
            "steps": {
                variant: (r["output_tokens"], r.get("engine_steps"), r.get("graph_steps"))
                for variant, r in (("none", row.get("plain")), ("default", row.get("spec")))
                if r
            },
        }
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", required=True, help=".jsonl of {prompt} or {messages}")
    p.add_argument("--concurrency", default="1,4,16,64,128")
    p.add_argument(
        "--variants", default="none,default",
        help="servers to run: none (plain), default (the shipped head), or BASE@LABEL for "
        "BASE with --variant-args LABEL's flags added (compared with BASE offline)",
    )  # fmt: skip
    p.add_argument(
        "--variant-args", action="append", default=[], metavar="LABEL=FLAGS",
        help="extra `specdec serve` flags of the BASE@LABEL variants (repeatable)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--waves", type=int, default=4, help="requests per run: max(16, W x c)")
    p.add_argument("--repeats", type=int, default=1, help="offline timed runs (median)")
    p.add_argument(
        "--client-concurrency", type=int, default=32,
        help="streams per bench-serve client process (more clients above it)",
    )  # fmt: skip
    p.add_argument("--server-args", default="", help="extra `specdec serve` flags")
    p.add_argument("--offline-args", default="", help="extra `specdec bench` flags")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--logs", help="copy each server's stamped log and the offline report here")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave the servers' prefix caching on (off by default, as offline: the runs "
        "cycle the same prompts, whose prefill a cache would skip)",
    )
    p.add_argument(
        "--py-spy", default="",
        help="py-spy executable: sample the server's processes at the largest concurrency",
    )  # fmt: skip
    p.add_argument("--py-spy-s", type=float, default=20, help="seconds py-spy samples")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.variant_args = parse_variant_args(args.variant_args)
    for variant in args.variants.split(","):
        variant_base(variant)
    work = Path(tempfile.mkdtemp(prefix="serve_load_"))
    servers = [run_server(v, args, work) for v in args.variants.split(",")]
    offline = {} if args.no_offline else run_offline(args, work)
    result = {"servers": servers, "offline": offline, "args": vars(args)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        for s in servers:
            shutil.copy(s["log"], args.logs)
            if s.get("stacks"):
                shutil.copy(s["stacks"], args.logs)
        if (work / "offline.json").exists():  # the offline bench's whole report
            shutil.copy(work / "offline.json", args.logs)

    def table(header: str, cells: Callable[[int, dict], list[str]]) -> None:
        """One row per (concurrency, server): ``| c | variant | cells... |``."""
        names = ["c", "variant", *header.split(" | ")]
        print("\n| " + " | ".join(names) + " |")
        print("|---:|---|" + "---:|" * (len(names) - 2))
        for c in args.concurrency:
            for s in servers:
                print(f"| {c} | {s['variant']} | " + " | ".join(cells(c, s)) + " |")

    def throughput(c: int, s: dict) -> list[str]:
        row = s["rows"].get(c, {})
        off = offline.get(c, {}).get(variant_base(s["variant"]))
        tau = row.get("tau")
        return [
            f"{row.get('tok_s', 0):,.0f}",
            f"{off:,.0f}" if off else "",
            f"{row['tok_s'] / off:.2f}" if off and row else "",
            f"{row.get('tpot_p50_ms', 0):.2f}",
            f"{tau:.2f}" if tau else "",
        ]

    def ttft(c: int, s: dict) -> list[str]:
        row = s["rows"].get(c, {})
        split = row.get("ttft_split_ms") or {}
        cells = [split.get(k) for k in ("ttft", *TTFT_PHASES, "rest")] + [row.get("client_ms")]
        return ["" if v is None else f"{v:.1f}" for v in cells]

    def steps(c: int, s: dict) -> list[str]:
        row = s["rows"].get(c, {})
        off = offline.get(c, {}).get("steps", {}).get(variant_base(s["variant"]))
        server = steps_cells(row.get("output_tokens"), row.get("steps"), row.get("graph_steps"))
        return [*server, *(steps_cells(*off) if off else ["", "", ""])]

    table("server tok/s | offline tok/s | server/offline | TPOT p50 ms | τ", throughput)
    print("\nServer TTFT, mean ms over each run's requests (/metrics): arrival -> sent to the")
    print("engine core (prepare: template, encoding) -> first step (queue) -> first token")
    print("(prefill) -> the request's stream (rest); client: a slot's cycle outside the server")
    print("(c x duration / completed, less the server's arrival-to-finish)")
    table("TTFT | prepare | queue | prefill | rest | client", ttft)
    print("\nEngine steps per run (/metrics; offline: the bench's), the eager ones (no CUDA")
    print("graph replayed) and output tokens per step")
    table("server steps | eager | tok/step | offline steps | eager | tok/step", steps)
    for s in servers:
        top = max(args.concurrency)
        print(f"{s['variant']}: /health after {s.get('health_s', float('nan')):.1f} s, "
              f"speculating after {s.get('speculation_s', float('nan')):.1f} s, "
              f"every graph after {s.get('graphs_s', float('nan')):.1f} s; "
              f"CPU share per thread at c={top}: {s.get('cpu_share')}")  # fmt: skip
        for share, frame in s.get("top_frames", []):
            print(f"   {share:6.1%}  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
