"""The batch-invariant attention kernels against the default Triton attention, on
SmolLM2-135M's heads (9 query, 3 KV heads of 64; 16-token pages), at the shapes a step
runs: decodes at batch 1, 16 and 64 over short and long contexts, and one prefill chunk.

Each case is timed as a CUDA graph of ``--calls`` back-to-back calls (no host gaps, as
inside the engine's graphs; ``skinny_gemm.time_graph``), median of ``--repeats`` replays,
for the default backend's kernel and every ``--block-n`` x ``--num-splits`` config of the
invariant one. The invariant rows also check their output against the default kernel's.

    python benchmarks/bench_invariant_attention.py --json out/invariant_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_int_list
from skinny_gemm import time_graph

from specdec.attention.triton_backend import TritonAttentionBackend
from specdec.kernels.invariant_attention import InvariantAttentionConfig, invariant_paged_attention
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.query_tiles import with_query_tiles

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(batch: int, context: int, q_len: int, gen: torch.Generator):
    """``batch`` sequences of ``context`` tokens whose last ``q_len`` are this step's
    queries; pages scattered in a random order. Returns (q, k_cache, v_cache, meta)."""
    pages = -(-context // BLOCK_SIZE)
    num_blocks = batch * pages + 1  # block 0 is the null block
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1
    n = batch * q_len
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(0, n + 1, q_len, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=perm.view(batch, pages).to(torch.int32),
        max_query_len=q_len,
        max_seq_len=context,
    )
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    return q, k_cache, v_cache, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x300x1,16x300x1,64x300x1,1x1500x1,64x1500x1,1x1024x1024",
                   help="batch x context x query rows, comma-separated")  # fmt: skip
    p.add_argument("--block-n", type=parse_int_list, default=[32, 64])
    p.add_argument("--num-splits", type=parse_int_list, default=[1, 4, 8, 16])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for case in a.cases.split(","):
        batch, context, q_len = (int(v) for v in case.split("x"))
        q, k_cache, v_cache, meta = make_case(batch, context, q_len, gen)
        meta = with_query_tiles(meta)

        args = (q, k_cache, v_cache, meta, scale)
        default = partial(TritonAttentionBackend._attend, *args)
        ref = default().float()
        base_us = time_graph(default, a.calls, a.repeats)
        row = {"batch": batch, "context": context, "q_len": q_len, "default_us": base_us}
        for bn, splits in itertools.product(a.block_n, a.num_splits):
            cfg = InvariantAttentionConfig(block_n=bn, num_splits=splits)
            invariant = partial(invariant_paged_attention, *args, config=cfg)
            err = (invariant().float() - ref).abs().max().item()
            us = time_graph(invariant, a.calls, a.repeats)
            row[f"n{bn}s{splits}_us"] = us
            row[f"n{bn}s{splits}_err"] = err
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = [f"n{bn}s{s}" for bn, s in itertools.product(a.block_n, a.num_splits)]
    print("| batch x context x q | default µs | " + " | ".join(keys) + " | max abs diff |")
    print("|---|---:|" + "---:|" * (len(keys) + 1))
    for r in rows:
        cells = " | ".join(f"{r[k + '_us']:.1f}" for k in keys)
        err = max(r[k + "_err"] for k in keys)
        case = f"{r['batch']}x{r['context']}x{r['q_len']}"
        print(f"| {case} | {r['default_us']:.1f} | {cells} | {err:.1e} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
