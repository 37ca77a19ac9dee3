"""What one pipelined step's CUDA graph replay spends on the device, from a Chrome trace of
``profile_spec_trace.py --trace-dir``: the median replay's span, its kernels' busy time,
the region before the target's verify forward (catch-up state, the head's catch-up and
draft levels), the verify forward, the tail (logits, argmax, acceptance), and the kernels
aggregated by name.

The verify forward is found as the last ``--target-layers`` attention launches of the
replay (one per target layer); its region starts ``--lead`` kernels before the first of
them (the layer's norm, QKV GEMM and RoPE/KV store) and ends at the last layer's MLP.

    python benchmarks/replay_kernels.py trace_chain3-b1-pipelined-compiled.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

ATTENTION = ("_prefill_kernel", "_decode_split_kernel", "_tree_", "_verify_")
SHORT = (  # substring -> short name, first match wins
    ("nvjet", "gemm"), ("gemm", "gemm"), ("rsqrt", "rmsnorm"), ("_rope_store", "rope+kv store"),
    ("_prefill_combine", "attention combine"), ("_prefill_kernel", "attention"),
    ("_decode_combine", "attention combine"), ("_decode_split", "attention"),
    ("memcpy", "memcpy"), ("silu", "silu*mul"), ("ArgMax", "argmax"), ("_accept", "accept"),
    ("indexSelect", "index_select"), ("scatter_gather", "gather"), ("elementwise", "elementwise"),
)  # fmt: skip
# A layer's kernels after its attention: combine, copy, o-proj, norm, gate_up, silu, down.
LAYER_TAIL = 7


def short(name: str) -> str:
    return next((s for key, s in SHORT if key in name), name[:40])


def replays(trace: dict) -> list[list[dict]]:
    """Each graph replay's device kernels (and copies) in start order."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = [e for e in events if e.get("name") == "cudaGraphLaunch"]
    by_corr: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy"):
            by_corr[e["args"].get("correlation")].append(e)
    out = [sorted(by_corr[x["args"]["correlation"]], key=lambda e: e["ts"]) for x in launches]
    return [r for r in out if r]


def regions(kernels: list[dict], target_layers: int, lead: int) -> tuple[dict[str, float], int]:
    """Microseconds of span per region (draft, verify, tail) of one replay, and the number
    of kernels before the verify forward ({} and 0 when the replay has too few layers)."""
    attention = [i for i, k in enumerate(kernels) if any(a in k["name"] for a in ATTENTION)]
    if len(attention) < target_layers:
        return {}, 0
    first = max(attention[-target_layers] - lead, 0)
    after = min(attention[-1] + LAYER_TAIL + 1, len(kernels) - 1)  # the tail's first kernel
    t0, t_end = kernels[0]["ts"], kernels[-1]["ts"] + kernels[-1]["dur"]
    start, stop = kernels[first]["ts"], kernels[after]["ts"]
    spans = {
        "before verify (state, catch-up, drafts)": start - t0,
        "verify forward": stop - start,
        "after verify (logits, argmax, accept)": t_end - stop,
    }
    return spans, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="Chrome trace (.json or .json.gz)")
    p.add_argument("--target-layers", type=int, default=30)
    p.add_argument("--lead", type=int, default=3, help="a layer's kernels before attention")
    a = p.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(Path(a.trace), "rt") as f:
        trace = json.load(f)
    all_replays = replays(trace)
    if not all_replays:
        raise SystemExit(f"{a.trace} holds no graph replay with device kernels")
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in all_replays]
    median = sorted(range(len(spans)), key=spans.__getitem__)[len(spans) // 2]
    kernels = all_replays[median]
    busy = sum(k["dur"] for k in kernels)
    print(f"{len(all_replays)} replays; median: span {spans[median]:.1f} us, busy {busy:.1f} us, "
          f"{len(kernels)} kernels (gaps {spans[median] - busy:.1f} us); "
          f"span over replays: median {statistics.median(spans):.1f}")  # fmt: skip
    spans, before = regions(kernels, a.target_layers, a.lead)
    for name, us in spans.items():
        print(f"  {name}: {us:.1f} us")
    print(f"  kernels before verify: {before}")
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        row = table[short(k["name"])]
        row[0] += 1
        row[1] += k["dur"]
    print("| kernel | count | device us |\n|---|---:|---:|")
    for name, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {count} | {us:.1f} |")


if __name__ == "__main__":
    main()
