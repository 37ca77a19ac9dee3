"""`specdec serve` against vLLM's CPU build on the same model, each measured by both clients.

Both servers load the same HF directory (SmolLM2-135M-Instruct by default: fp32, eager,
max-model-len 1024, 2 GiB of KV cache each, no speculation) and are loaded, one at a time
(never both: they would share the cores), by vLLM's own serving benchmark (``vllm bench
serve --backend openai-chat``, run with the vLLM venv's python) and by ``specdec
bench-serve``, at each concurrency. Every run sends the same chat requests: N =
max(--num-prompts, 4 x c) single-turn user prompts from a ``specdec bench`` set, cycled in
the same order, greedy, exactly --max-tokens tokens each (``ignore_eos``). vLLM keeps its
CPU defaults: on x86 its OpenMP threads are pinned to all cores but one, which it reserves
for its API server and scheduler (the JSON's ``cpu_binding``); specdec uses torch's.

    python benchmarks/serve_vs_vllm_cpu.py --json serve_vs_vllm_cpu.json

The table printed last: output tok/s, TPOT p50 and TTFT p50 per (server, client, c), and
specdec's output tok/s over vLLM's per (client, c). TTFT1 is the time to the first chunk
with text (vLLM's client stops its TTFT clock at the first streamed chunk of any kind; both
servers send the assistant-role chunk with the first token).

The numbers mean little while other jobs share the cores, so before the first server starts
the script waits (--quiet-load, --quiet-wait-s) for a low 1-minute load average; before
each run it waits (--others-max, --run-wait-s) until other users' processes take little of
the CPU, and it repeats a run (--retries) they disturbed (benchmarks/foreign_cpu.py). The
table's "others' CPU" is their share of the cores during the run kept; the load averages
and the discarded attempts are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import foreign_cpu
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the servers' launchers, shared with the tests

from serve_server import ServerProcess, start_server  # noqa: E402
from vllm_server import exclusive_vllm, start_vllm  # noqa: E402

SERVERS = ("specdec", "vllm")
CLIENTS = ("vllm", "specdec")
# This build's `vllm` console script dies asking importlib.metadata for "vllm" (the
# distribution is "vllm-cpu"); the same CLI entry point runs with that name mapped.
VLLM_CLI = (
    "import importlib.metadata as m, sys\n"
    "version = m.version\n"
    "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name)\n"
    "sys.argv[0] = 'vllm'\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)
# vLLM's client runs in the venv: specdec's test-time settings kept out, no hub access.
_CLIENT_DROPPED_ENV = ("TRITON_INTERPRET", "PYTHONPATH", "VIRTUAL_ENV")
# vLLM's per-request lists (--save-detailed), read here and left out of the JSON.
_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                "queue_times", "generated_texts", "errors")  # fmt: skip


@dataclass
class Run:
    """One client's pass over one server at one concurrency (figures in ms and tok/s)."""

    server: str
    client: str
    concurrency: int
    num_prompts: int
    output_throughput: float | None = None
    tpot_p50_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft1_p50_ms: float | None = None  # to the first chunk with text
    completed: int = 0
    failed: int = 0
    errors: list[str] | None = None
    wall_s: float = 0.0
    load_before: list[float] | None = None
    load_after: list[float] | None = None
    others_cpu: float | None = None  # other users' share of the cores during the run
    discarded: list[dict] | None = None  # earlier attempts that others disturbed
    raw: dict | None = None


@dataclass(frozen=True)
class Setup:
    """What every client run needs besides the run and the server."""

    args: argparse.Namespace
    vllm_py: Path  # the vLLM venv's python
    hf_dir: Path  # both servers' model, and the tokenizer of vLLM's client
    work: Path  # prompt files, client logs and raw reports


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def wait_quiet(threshold: float, max_wait_s: float, every_s: float = 30.0) -> list[dict]:
    """Poll the 1-minute load average until it is below ``threshold`` or ``max_wait_s``
    passes; returns every sample (the last one decides whether the machine was quiet)."""
    start = time.monotonic()
    samples = []
    while True:
        load = loadavg()
        samples.append({"t_s": round(time.monotonic() - start, 1), "loadavg": load})
        print(f"load average {load} (want 1-min < {threshold})", flush=True)
        if load[0] < threshold or time.monotonic() - start + every_s > max_wait_s:
            return samples
        time.sleep(every_s)


def export_prompts(args, work: Path) -> list[str]:
    """The first --num-prompts prompts of --set that fit, each a single user message."""
    out = work / "prompts"
    subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--sets", args.set,
         "--num-prompts", str(args.num_prompts), "--max-prompt-tokens",
         str(args.max_prompt_tokens), "--max-tokens", str(args.max_tokens),
         "--max-model-len", str(args.max_model_len), "--model", args.model,
         "--no-download", "--export-prompts", str(out)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    prompts = []
    for line in (out / f"{args.set}.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        if [m["role"] for m in messages] != ["user"]:
            raise SystemExit(
                f"a {args.set} prompt has roles {[m['role'] for m in messages]}; vLLM's "
                "ShareGPT dataset sends one user message, so pick a single-turn set"
            )
        prompts.append(messages[0]["content"])
    if len(prompts) < args.num_prompts:
        raise SystemExit(
            f"{args.set} has {len(prompts)} prompts of at most {args.max_prompt_tokens} "
            f"tokens; --num-prompts is {args.num_prompts}: raise --max-prompt-tokens"
        )
    return prompts


def prompts_files(prompts: list[str], n: int, work: Path) -> tuple[Path, Path]:
    """``n`` prompts cycled in order, for specdec's client (jsonl) and vLLM's (ShareGPT
    JSON: its ``custom`` dataset needs pandas, which the vLLM venv lacks). Both clients send
    exactly these, in this order (vLLM's datasets would otherwise oversample at random)."""
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    specdec_file, vllm_file = work / f"prompts_{n}.jsonl", work / f"prompts_{n}.sharegpt.json"
    specdec_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in cycled))
    # A second (empty) turn: the dataset skips single-turn entries; its text is unused
    # since --sharegpt-output-len sets every output length.
    turns = [[{"from": "human", "value": p}, {"from": "gpt", "value": ""}] for p in cycled]
    vllm_file.write_text(json.dumps([{"conversations": t} for t in turns]))
    return specdec_file, vllm_file


def served_model(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=10)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run_vllm_client(run: Run, setup: Setup, url: str, model: str, prompts: Path) -> None:
    args, work = setup.args, setup.work
    name = f"{run.server}_vllm-client_c{run.concurrency}"
    command = [
        str(setup.vllm_py), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model,
        "--tokenizer", str(setup.hf_dir), "--dataset-name", "sharegpt", "--dataset-path",
        str(prompts), "--disable-shuffle", "--num-prompts", str(run.num_prompts),
        "--sharegpt-output-len", str(args.max_tokens),
        "--ignore-eos", "--temperature", "0", "--max-concurrency", str(run.concurrency),
        "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
        "--result-dir", str(work), "--result-filename", f"{name}.json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in _CLIENT_DROPPED_ENV}
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = _client(command, env, work / f"{name}.log", run)
    if proc.returncode != 0:
        run.errors = [f"exit {proc.returncode}: {_tail(work / f'{name}.log')}"]
        return
    raw = json.loads((work / f"{name}.json").read_text())
    ok = [i for i, e in enumerate(raw["errors"]) if not e]
    # The first gap after TTFT is the wait for the first text when TTFT stopped at a
    # chunk without text (the assistant role alone); about zero when the role came with it.
    ttft1 = [raw["ttfts"][i] + (raw["itls"][i][0] if raw["itls"][i] else 0.0) for i in ok]
    run.output_throughput = raw["output_throughput"]
    run.tpot_p50_ms = raw["median_tpot_ms"]
    run.ttft_p50_ms = raw["median_ttft_ms"]
    run.ttft1_p50_ms = _p50_ms(ttft1)
    run.completed, run.failed = raw["completed"], raw["failed"]
    run.errors = sorted({e.strip()[-500:] for e in raw["errors"] if e})[:5]
    run.raw = {k: v for k, v in raw.items() if k not in _PER_REQUEST}
    run.raw["output_lens_set"] = sorted(set(raw["output_lens"]))


def run_specdec_client(
    run: Run, setup: Setup, url: str, model: str, prompts: Path, work: Path | None = None
) -> None:
    args, work = setup.args, work or setup.work
    name = f"{run.server}_specdec-client_c{run.concurrency}"
    command = [
        sys.executable, "-m", "specdec.cli", "bench-serve", "--base-url", url,
        "--endpoint", "chat", "--model", model, "--prompts-file", str(prompts),
        "--num-prompts", str(run.num_prompts), "--max-tokens", str(args.max_tokens),
        "--temperature", "0", "--ignore-eos", "--concurrency", str(run.concurrency),
        "--json", str(work / f"{name}.json"),
    ]  # fmt: skip
    proc = _client(command, dict(os.environ), work / f"{name}.log", run)
    if proc.returncode != 0:
        run.errors = [f"exit {proc.returncode}: {_tail(work / f'{name}.log')}"]
        return
    raw = json.loads((work / f"{name}.json").read_text())
    run.output_throughput = raw["output_throughput"]
    run.tpot_p50_ms = raw["tpot_ms"]["p50"]
    run.ttft_p50_ms = run.ttft1_p50_ms = raw["ttft_ms"]["p50"]  # it counts text chunks only
    run.completed, run.failed = raw["completed"], raw["failed"]
    run.errors = raw["errors"]
    run.raw = raw


def _client(command: list[str], env: dict, log: Path, run: Run) -> subprocess.CompletedProcess:
    run.load_before = loadavg()
    before = foreign_cpu.sample()
    with log.open("w") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    after = foreign_cpu.sample()
    run.wall_s = after.t - before.t
    run.others_cpu = foreign_cpu.others_share(before, after)
    run.load_after = loadavg()
    return proc


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:]


def _p50_ms(seconds: list[float]) -> float | None:
    if not seconds:
        return None
    s = sorted(seconds)
    mid = len(s) // 2
    return 1e3 * (s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2)


def start(server: str, setup: Setup) -> ServerProcess:
    if server == "specdec":
        return start_server([
            "--model", str(setup.hf_dir), "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(setup.args.kv_cache_gib << 30),
            "--max-model-len", str(setup.args.max_model_len), "--draft", "none", "--seed", "0",
        ])  # fmt: skip
    # start_vllm fixes fp32, eager, max-model-len 1024 and a 2 GiB KV cache.
    return start_vllm(setup.vllm_py, setup.hf_dir, [])


def undisturbed_run(run: Run, setup: Setup, url: str, model: str, files: dict[str, Path]) -> Run:
    """``run`` once others leave the CPU (--others-max, --run-wait-s), again (--retries)
    if they took more than that meanwhile; the disturbed attempts go in ``discarded``."""
    args = setup.args
    discarded: list[dict] = []
    while True:
        quiet, waited = foreign_cpu.wait_for_quiet(args.others_max, args.run_wait_s)
        attempt = replace(run, discarded=discarded)
        if run.client == "vllm":
            run_vllm_client(attempt, setup, url, model, files["vllm"])
        else:
            run_specdec_client(attempt, setup, url, model, files["specdec"])
        if attempt.others_cpu <= args.others_max or len(discarded) == args.retries:
            return attempt
        print(f"[{run.server}] {run.client} client c={run.concurrency}: others took "
              f"{attempt.others_cpu:.0%} of the CPU: again", flush=True)  # fmt: skip
        discarded.append({"others_cpu": attempt.others_cpu, "quiet_before": quiet,
                          "waited_s": waited, "tok_s": attempt.output_throughput,
                          "tpot_p50_ms": attempt.tpot_p50_ms})  # fmt: skip


def serve_and_measure(server: str, setup: Setup, prompts: list[str]) -> tuple[dict, list[Run]]:
    """Start ``server``, warm it up, run every (c, client), stop it."""
    args, work = setup.args, setup.work
    info: dict = {"load_before": loadavg()}
    t0 = time.monotonic()
    proc = start(server, setup)
    info["log"] = str(proc.log)
    runs = []
    try:
        proc.wait_ready(timeout=args.start_timeout)
        info["ready_s"] = time.monotonic() - t0
        model = served_model(proc.url)
        info["model_id"] = model
        print(f"[{server}] ready after {info['ready_s']:.1f} s, model {model}", flush=True)
        # First requests pay one-time costs (allocator, kernels' first calls): untimed.
        warm = Run(server, "specdec", max(args.concurrency), len(prompts))
        warm_file, _ = prompts_files(prompts, len(prompts), work)
        run_specdec_client(warm, setup, proc.url, model, warm_file, work / "warmup")
        info["warmup"] = {"wall_s": warm.wall_s, "errors": warm.errors}
        for c in args.concurrency:
            n = max(args.num_prompts, 4 * c)
            specdec_file, vllm_file = prompts_files(prompts, n, work)
            for client in args.clients:
                files = {"vllm": vllm_file, "specdec": specdec_file}
                run = undisturbed_run(Run(server, client, c, n), setup, proc.url, model, files)
                runs.append(run)
                print(
                    f"[{server}] {client} client c={c}: {run.output_throughput} tok/s, "
                    f"TPOT p50 {run.tpot_p50_ms} ms, TTFT p50 {run.ttft_p50_ms} ms, "
                    f"others {run.others_cpu:.0%}, failed {run.failed}, errors {run.errors}",
                    flush=True,
                )
    finally:
        proc.stop()
    lines = Path(info["log"]).read_text(errors="replace").splitlines()
    info["warnings"] = sorted({ln[-300:] for ln in lines if "WARN" in ln or "ERROR" in ln})[:30]
    # vLLM's CPU worker pins its OpenMP threads and reserves cores: the log says which.
    info["cpu_binding"] = [ln for ln in lines if "core ids=" in ln or "reserved_cpus" in ln]
    info["unhandled_errors"] = proc.unhandled_errors()[:10]
    info["load_after"] = loadavg()
    return info, runs


def versions(vllm_py: Path) -> dict:
    import torch

    probe = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({'vllm': m.version('vllm-cpu'), 'torch': m.version('torch')}))"
    )
    out = subprocess.run([str(vllm_py), "-c", probe], capture_output=True, text=True, check=True)
    venv = json.loads(out.stdout.strip().splitlines()[-1])
    git = ["git", "-C", str(ROOT)]  # read-only queries
    return {
        "nproc": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "vllm": venv["vllm"],
        "vllm_torch": venv["torch"],
        "git_head": _read([*git, "rev-parse", "HEAD"]).strip(),
        "git_dirty": _read([*git, "status", "--porcelain"]).splitlines(),
    }


def _read(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(runs: list[Run]) -> str:
    lines = [
        "| server | client | c | N | output tok/s | TPOT p50 ms | TTFT p50 ms | TTFT1 p50 ms "
        "| others' CPU | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.server} | {r.client} | {r.concurrency} | {r.num_prompts} "
            f"| {_fmt(r.output_throughput)} | {_fmt(r.tpot_p50_ms)} | {_fmt(r.ttft_p50_ms)} "
            f"| {_fmt(r.ttft1_p50_ms)} | {_fmt(100 * r.others_cpu, '.0f')}% "
            f"| {r.failed if r.raw else 'client died'} |"
        )
    lines += ["", "| client | c | specdec / vLLM output tok/s |", "|---|---:|---:|"]
    by_key = {(r.server, r.client, r.concurrency): r.output_throughput for r in runs}
    for client, c in sorted({(r.client, r.concurrency) for r in runs}):
        ours, theirs = by_key.get(("specdec", client, c)), by_key.get(("vllm", client, c))
        ratio = ours / theirs if ours and theirs else None
        lines.append(f"| {client} | {c} | {_fmt(ratio, '.2f')} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="specdec model alias or HF directory; both servers load its HF dir",
    )
    p.add_argument("--set", default="writingbench", help="`specdec bench` prompt set")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="distinct prompts; a run at c sends max(this, 4 x c)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=512,
        help="skip longer prompts (chat template included)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=1024,
        help="specdec's; vLLM's is fixed at 1024 by tests/vllm_server.py",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=2,
        help="specdec's KV cache (vLLM's: VLLM_CPU_KVCACHE_SPACE=2)",
    )
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated")
    p.add_argument("--servers", default=",".join(SERVERS), help="run in this order")
    p.add_argument("--clients", default=",".join(CLIENTS), help="run in this order per c")
    p.add_argument(
        "--quiet-load",
        type=float,
        default=0.7,
        help="wait for a 1-minute load average below this before starting",
    )
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=900,
        help="longest wait for a quiet machine (then run anyway)",
    )
    p.add_argument(
        "--others-max",
        type=float,
        default=0.1,
        help="other users' largest share of the cores during a run; past it, the run is "
        "done again (see benchmarks/foreign_cpu.py)",
    )
    p.add_argument("--retries", type=int, default=2, help="repeats of a disturbed run")
    p.add_argument(
        "--run-wait-s",
        type=float,
        default=600,
        help="before each run, longest wait for others to drop under --others-max",
    )
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to /health")
    p.add_argument("--workdir", help="client logs and raw results (default: a temp dir)")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.servers = args.servers.split(",")
    args.clients = args.clients.split(",")
    for name, given, known in (
        ("servers", args.servers, SERVERS),
        ("clients", args.clients, CLIENTS),
    ):
        if unknown := set(given) - set(known):
            raise SystemExit(f"--{name} {sorted(unknown)} unknown; choose from {known}")
    if args.max_model_len != 1024 and "vllm" in args.servers:
        raise SystemExit(f"--max-model-len {args.max_model_len}; vLLM runs with 1024")

    from specdec.models import resolve_model

    hf_dir = resolve_model(args.model).hf_dir
    work = Path(args.workdir or tempfile.mkdtemp(prefix="serve_vs_vllm_"))
    (work / "warmup").mkdir(parents=True, exist_ok=True)
    prompts = export_prompts(args, work)[: args.num_prompts]
    result: dict = {
        "command": [sys.executable, *sys.argv],
        "args": vars(args),
        "hf_dir": str(hf_dir),
        "workdir": str(work),
        "prompts": prompts,
    }
    # The lock keeps the test suite's vLLM servers off these cores meanwhile.
    with exclusive_vllm() as vllm_py:
        result |= versions(vllm_py)
        result["quiet_wait"] = wait_quiet(args.quiet_load, args.quiet_wait_s)
        result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        result["servers"], runs = {}, []
        setup = Setup(args, vllm_py, hf_dir, work)
        for server in args.servers:
            result["servers"][server], server_runs = serve_and_measure(server, setup, prompts)
            runs += server_runs
    result["load_end"] = loadavg()
    result["runs"] = [vars(r) for r in runs]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(
        f"\n{result['date']}  HEAD {result['git_head']}  nproc {result['nproc']}  "
        f"torch {result['torch']}  vLLM {result['vllm']} (torch {result['vllm_torch']})"
    )
    print(f"load average: start {result['quiet_wait'][-1]['loadavg']}, end {result['load_end']}\n")
    print(table(runs))
    return 0 if all(r.raw for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
