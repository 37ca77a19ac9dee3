"""A dynamic tree level's ranking: the Triton log-softmax + top-k (``kernels/topk.py``)
against the torch path it replaces (log-softmax, then ``chunked_topk``), each captured in
a CUDA graph and replayed, as the engine runs them.

Rows are a level's logits: ``[batch * top_k, draft_vocab]`` (batch 1 and 16 of a top-8
tree over the 16,384-id draft vocabulary by default), plus the root level's
``[batch, draft_vocab]``.

    python benchmarks/bench_level_topk.py --json out/level_topk.json   # on the H200
    python benchmarks/bench_level_topk.py --smoke                        # CPU, interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specdec.kernels.topk import log_softmax_topk, log_softmax_topk_ref


def graph_time_us(fn, x: torch.Tensor, k: int, replays: int) -> float:
    """Median µs per replay of ``fn(x, k)`` captured in a CUDA graph (10 calls per graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x, k)  # compile and warm outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn(x, k)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 10)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=common.parse_int_list, default=[1, 8, 16, 128])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="CPU: check outputs only, no timing")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = getattr(torch, a.dtype)
    results = []
    for rows in a.rows:
        x = torch.randn(rows, a.vocab, device=device).mul(3).to(dtype)
        values, _ = log_softmax_topk(x, a.k)
        ref_values, _ = log_softmax_topk_ref(x, a.k)
        torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=1e-5)
        row = {"rows": rows, "vocab": a.vocab, "k": a.k, "dtype": a.dtype}
        if not a.smoke:
            compiled_ref = torch.compile(log_softmax_topk_ref, fullgraph=True)
            row["torch_us"] = graph_time_us(compiled_ref, x, a.k, a.replays)
            row["triton_us"] = graph_time_us(log_softmax_topk, x, a.k, a.replays)
        results.append(row)
    print("| rows × vocab | torch (compiled) µs | Triton µs |")
    print("|---|---:|---:|")
    for r in results:
        t, k = r.get("torch_us"), r.get("triton_us")
        print(f"| {r['rows']} × {r['vocab']} | {t or 0:.1f} | {k or 0:.1f} |")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"rows": results}, indent=1))


if __name__ == "__main__":
    main()
