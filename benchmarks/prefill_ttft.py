"""Where a batch-1 prefill's time goes: is TTFT paid per *new prompt length*?

On the H200 a ~130-token prompt waited ~35 ms for its first token (BENCHMARKS.md, sessions
19 and 21), plain and speculative alike, although its prefill is ~2 ms of device work.
Session 22 ran this script: new, repeated and padded lengths waited alike (not a
per-shape cost), and the host-op table showed ~800 launches from Python. Prefill CUDA
graphs (``EngineConfig.prefill_graph_max_tokens``; 0 here gives the eager peer) brought
it to 3.4 ms. The cases, on one plain engine (no draft head needed):

- ``new``: ``--n`` prompts of distinct lengths ``--length``, ``--length`` + 1, ... (each
  length first seen here);
- ``same``: one prompt of ``--length`` tokens again and again (every shape warm);
- ``padded``: the ``new`` lengths rounded up to a multiple of ``--pad`` tokens (what
  bucketing prefills would give: few distinct shapes).

Each request generates one token (``max_tokens=1``, greedy), so its wall time is its TTFT
plus the engine's bookkeeping. Then one ``new``-length request under the torch profiler:
device busy time (the union of kernel intervals) against its wall time, and the kernel
count. Prompts are token ids (no tokenizer in the timing).

    python benchmarks/prefill_ttft.py --n 32 --length 100 --json $OUT/prefill_ttft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def timed(llm, prompt: list[int], params) -> float:
    """Seconds for one request of ``prompt`` (its first token, with bookkeeping)."""
    common.synchronize(llm.engine.runner.device)
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    common.synchronize(llm.engine.runner.device)
    return time.perf_counter() - t0


def device_busy_us(prof) -> tuple[float, int]:
    """Microseconds of the union of device kernel intervals, and the kernel count."""
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return common.union_length(spans), len(spans)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--n", type=int, default=32, help="requests per case")
    p.add_argument("--length", type=int, default=100, help="first prompt length (tokens)")
    p.add_argument("--pad", type=int, default=64, help="the padded case's length multiple")
    p.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=None,
        help="EngineConfig.prefill_graph_max_tokens (0: prefills run eagerly; default: the "
        "engine's)",
    )
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--trace", help="write the profiled request's Chrome trace here (.json.gz)")
    p.add_argument("--top", type=int, default=25, help="host ops listed by self CPU time")
    a = p.parse_args()
    if a.n < 2 or a.length < 2 or a.pad < 1:
        p.error("--n and --length must be >= 2, --pad >= 1")
    from specdec import LLM, SamplingParams

    device = common.resolve_device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    extra = {}
    if a.prefill_graph_max_tokens is not None:
        extra["prefill_graph_max_tokens"] = a.prefill_graph_max_tokens
    t0 = time.perf_counter()
    llm = LLM(a.model, dtype=dtype, device=device.type, enable_prefix_caching=False, **extra)
    build_s = time.perf_counter() - t0
    print(f"engine built in {build_s:.1f} s")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = llm.engine.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    timed(llm, prompt(a.length - 1), params)  # engine warm-up on a length no case uses
    lengths = [a.length + i for i in range(a.n)]
    same = prompt(a.length)
    cases = {
        "new": [timed(llm, prompt(n), params) for n in lengths],
        "same": [timed(llm, same, params) for _ in lengths],
        "padded": [timed(llm, prompt(-(-n // a.pad) * a.pad), params) for n in lengths],
    }
    rows = []
    for name, seconds in cases.items():
        ms = [s * 1e3 for s in seconds]
        rows.append(
            {"case": name, "median_ms": statistics.median(ms), "first_ms": ms[0], "max_ms": max(ms)}
        )
    profile: dict[str, float] = {}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = timed(llm, prompt(a.length + a.n + 7), params)
        busy, kernels = device_busy_us(prof)
        if a.trace:
            prof.export_chrome_trace(a.trace)
        # Where the host's time goes when the device is mostly idle.
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
        profile = {"wall_ms": wall * 1e3, "device_busy_ms": busy / 1e3, "kernels": kernels}
    print("| case | median ms | first ms | max ms |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.2f} | {r['first_ms']:.2f} | {r['max_ms']:.2f} |")
    if profile:
        print(
            f"profiled new-length request: wall {profile['wall_ms']:.2f} ms (profiler on), "
            f"device busy {profile['device_busy_ms']:.2f} ms, {profile['kernels']} kernels"
        )
    if a.json:
        env = common.env_info(device, getattr(torch, dtype))
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "env": env,
            "args": vars(a),
            "build_s": build_s,
            "rows": rows,
            "profile": profile,
        }
        out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
