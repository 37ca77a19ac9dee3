"""The batch-invariant attention kernels against the default Triton attention, on
SmolLM2-135M's heads (9 query, 3 KV heads of 64; 16-token pages), at the shapes a step
runs: decodes at batch 1, 16 and 64 over short and long contexts, one prefill chunk, and
verify trees (a case ending in ``t``: its query rows are one random tree per sequence).

Each case is timed as a CUDA graph of ``--calls`` back-to-back calls (no host gaps, as
inside the engine's graphs; ``skinny_gemm.time_graph``), median of ``--repeats`` replays,
for the default backend's kernel and every ``--block-n`` x ``--num-splits`` x
``--tree-tile`` x ``--shared-tree-from`` x ``--split-programs`` x ``--num-warps`` x
``--num-stages`` config of the invariant one (``--tree-tile``: tree rows per shared query
tile, ``ops.query_tiles.TREE_TILE_TOKENS``; ``--shared-tree-from``: the cache index from
which every launch's trees share tiles, or auto for the engine's rule,
``query_tiles.shared_tree_from``; ``--split-programs``: programs per query tile and KV
head, ``auto`` for the launch's own choice; ``--num-warps``: the split kernel's warps, a
constant of the result like ``block_n``; ``--num-stages``: its loops' software-pipelining
stages, ``auto`` for Triton's default). The invariant rows also check their output
against the default kernel's, and the column ``bits`` whether every config of one
``block_n`` x ``num_splits`` x ``num_warps`` gave the same bits (the tree tile, the
programs and the stages must change none), and ``warps`` whether the configs differing
only in ``num_warps`` did too (where they do, the warps could follow the launch like the
programs).

    python benchmarks/bench_invariant_attention.py --json out/invariant_attention.json
    python benchmarks/bench_invariant_attention.py --cases 1x300x32t,1x1000x32t,64x300x1 \
        --block-n 32 --num-splits 16 --shared-tree-from auto,0,1024,100000
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

import specdec.ops.query_tiles as query_tiles
from specdec.attention.tree_mask import build_tree_mask
from specdec.attention.triton_backend import TritonAttentionBackend
from specdec.kernels.invariant_attention import InvariantAttentionConfig, invariant_paged_attention
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.query_tiles import with_query_tiles
from specdec.ops.tree_paths import with_tree_paths

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(batch: int, context: int, q_len: int, tree: bool, gen: torch.Generator):
    """``batch`` sequences of ``context`` tokens whose last ``q_len`` are this step's
    queries (with ``tree``, the nodes of one random tree per sequence, each node's parent
    an earlier node); pages scattered in a random order. Returns (q, k_cache, v_cache,
    meta)."""
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
    if tree:
        parents = []
        for _ in range(batch):
            draws = torch.rand(q_len, generator=gen, device="cuda")
            up = (draws * torch.arange(q_len, device="cuda")).long()  # node i: one of 0..i-1
            parents.append(up)  # node 0's 0: the root
        meta = with_tree_paths(build_tree_mask(parents).attach(meta))
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    return q, k_cache, v_cache, meta


def parse_programs(text: str) -> list[int | None]:
    """Parse "auto,1,4" into [None, 1, 4] (None: the launch's or Triton's own choice)."""
    return [None if v.strip() == "auto" else parse_int_list(v)[0] for v in text.split(",")]


def parse_index_or_auto(text: str) -> list[int | None]:
    """Parse "auto,0,1024" into [None, 0, 1024]: cache indices >= 0, or auto."""
    out: list[int | None] = []
    for v in text.split(","):
        v = v.strip()
        if v != "auto" and not v.isdigit():
            raise ValueError(f"expected cache indices >= 0 or auto, got {v!r} in {text!r}")
        out.append(None if v == "auto" else int(v))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x300x1,16x300x1,64x300x1,1x1500x1,64x1500x1,1x1024x1024",
                   help="batch x context x query rows, comma-separated")  # fmt: skip
    p.add_argument("--block-n", type=parse_int_list, default=[32, 64])
    p.add_argument("--num-splits", type=parse_int_list, default=[1, 4, 8, 16])
    p.add_argument(
        "--tree-tile",
        type=parse_int_list,
        default=[query_tiles.TREE_TILE_TOKENS],
        help="tree rows per query tile (default: the engine's)",
    )
    p.add_argument(
        "--shared-tree-from",
        type=parse_index_or_auto,
        default=[None],
        help="cache index from which every launch's trees share tiles, or auto: the "
        "engine's rule (default)",
    )
    p.add_argument(
        "--split-programs",
        type=parse_programs,
        default=[None],
        help="programs per query tile and KV head, or auto: sized to the launch (default)",
    )
    p.add_argument(
        "--num-warps", type=parse_int_list, default=[InvariantAttentionConfig().num_warps]
    )
    p.add_argument(
        "--num-stages",
        type=parse_programs,
        default=[None],
        help="software-pipelining stages of the split kernel, or auto: Triton's (default)",
    )
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    rule = (query_tiles.FEW_ROWS, query_tiles.MANY_ROWS, query_tiles.LONG_TREE_KEYS)
    rows = []
    configs = [
        (bn, splits, tt, sf, sp, warps, stages)
        for bn, splits, tt, sf, sp, warps, stages in itertools.product(
            a.block_n,
            a.num_splits,
            a.tree_tile,
            a.shared_tree_from,
            a.split_programs,
            a.num_warps,
            a.num_stages,
        )
        if sp is None or sp <= splits
    ]
    keys = [
        f"n{bn}s{splits}"
        + (f"t{tt}" if len(a.tree_tile) > 1 else "")
        + (f"k{sf if sf is not None else 'auto'}" if len(a.shared_tree_from) > 1 else "")
        + (f"p{sp or 'auto'}" if len(a.split_programs) > 1 else "")
        + (f"w{warps}" if len(a.num_warps) > 1 else "")
        + (f"g{stages or 'auto'}" if len(a.num_stages) > 1 else "")
        for bn, splits, tt, sf, sp, warps, stages in configs
    ]
    for case in a.cases.split(","):
        tree = case.endswith("t")
        batch, context, q_len = (int(v) for v in case.removesuffix("t").split("x"))
        q, k_cache, v_cache, meta = make_case(batch, context, q_len, tree, gen)

        args = (q, k_cache, v_cache, meta, scale)
        default = partial(TritonAttentionBackend._attend, *args)
        ref = default().float()
        base_us = time_graph(default, a.calls, a.repeats)
        row = {"case": case, "batch": batch, "context": context, "q_len": q_len, "tree": tree}
        row["default_us"] = base_us
        outputs: dict[tuple[int, int, int], torch.Tensor] = {}  # the first of each grouping
        by_split: dict[tuple[int, int], torch.Tensor] = {}  # ... whatever the warps
        row["bits"] = row["warps_bits"] = True
        for key, (bn, splits, tree_tile, shared_from, programs, warps, stages) in zip(
            keys, configs, strict=True
        ):
            query_tiles.TREE_TILE_TOKENS = tree_tile  # the tiles and the launch read them
            query_tiles.FEW_ROWS, query_tiles.MANY_ROWS, query_tiles.LONG_TREE_KEYS = (
                rule if shared_from is None else (0, 1 << 30, shared_from)
            )
            tiled = with_query_tiles(meta)
            cfg = InvariantAttentionConfig(
                block_n=bn,
                num_splits=splits,
                num_warps=warps,
                split_programs=programs,
                num_stages=stages,
            )
            invariant = partial(
                invariant_paged_attention, q, k_cache, v_cache, tiled, scale, config=cfg
            )
            out = invariant()
            first = outputs.setdefault((bn, splits, warps), out)
            row["bits"] = row["bits"] and torch.equal(out, first)
            same = torch.equal(out, by_split.setdefault((bn, splits), out))
            row["warps_bits"] = row["warps_bits"] and same
            row[f"{key}_us"] = time_graph(invariant, a.calls, a.repeats)
            row[f"{key}_err"] = (out.float() - ref).abs().max().item()
        rows.append(row)
        print(json.dumps(row), flush=True)
    head = "| batch x context x q | default µs | " + " | ".join(keys)
    print(head + " | max abs diff | bits | warps |")
    print("|---|---:|" + "---:|" * (len(keys) + 1) + "---|---|")
    for r in rows:
        cells = " | ".join(f"{r[k + '_us']:.1f}" for k in keys)
        err = max(r[k + "_err"] for k in keys)
        bits = " | ".join("equal" if r[k] else "DIFFER" for k in ("bits", "warps_bits"))
        print(f"| {r['case']} | {r['default_us']:.1f} | {cells} | {err:.1e} | {bits} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
