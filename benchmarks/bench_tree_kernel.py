"""Tree-verify attention: the varlen kernel on verify shapes, against the decode kernel.

A verify step runs the varlen (prefill/extend) kernel with the tree mask over ``q`` new
tokens per sequence; a plain decode step runs the split-K decode kernel over one. This
script times both on the same paged bf16 cache (SmolLM2's attention shape by default) for
each batch, context and ``q``, under the default tile configuration and a sweep, so the
ratio a verify step pays in attention is visible per layer.

    python benchmarks/bench_tree_kernel.py --json out/tree_kernel.json   # on the H200
    python benchmarks/bench_tree_kernel.py --smoke                         # CPU, interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from specdec.attention.tree_mask import build_tree_mask
from specdec.kernels import paged_attention, paged_decode
from specdec.kernels.launch import num_sms
from specdec.kernels.prefill import PrefillConfig, default_prefill_config, paged_attention_ref
from specdec.ops.attention_metadata import AttentionMetadata


@dataclass
class Row:
    batch: int
    context: int
    q: int
    config: str  # "decode", or block_m/block_n/split ("*" = the default choice)
    us: float  # median microseconds per launch
    vs_decode: float  # us / decode us at the same batch and context
    max_err: float  # vs the reference, first sequence


def make_inputs(
    batch: int, context: int, q: int, heads: int, kv_heads: int, dim: int, device, gen,
    bound: int | None = None,
):  # fmt: skip
    """A random tree of ``q`` nodes (root first) at the end of each sequence's context.
    ``bound``: the host's ``max_seq_len`` (default: the real one), as a CUDA graph captures
    it (the context limit), which the split-K heuristic reads."""
    block_size = 16
    seq_len = context + q
    nb = -(-seq_len // block_size)
    num_blocks = batch * nb + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = perm.view(batch, nb).to(torch.int32)
    cache_shape = (num_blocks, block_size, kv_heads, dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * q, dtype=torch.int64),
        query_start_loc=torch.arange(0, (batch + 1) * q, q, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
        block_tables=tables,
        max_query_len=q,
        max_seq_len=max(seq_len, bound or 0),
    )
    if q > 1:
        parents = [0] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, q)]
        meta = build_tree_mask([torch.tensor(parents)] * batch).attach(meta)
    on_device = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()
    }
    meta = AttentionMetadata(**on_device)
    qt = torch.randn(batch * q, heads, dim, generator=gen).to(device, dtype)
    return qt, k_cache, v_cache, meta


def median_us(fn, device: torch.device, repeats: int) -> float:
    if device.type != "cuda":
        return common.measure(fn, device, warmup=3, repeats=repeats) * 1e6
    for _ in range(3):
        fn()
    # Replay the launches from a CUDA graph, as the engine does: timing Python launches
    # would measure the host (tens of microseconds), not the kernel.
    iters = 20
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--q", default="4,6,64,65")
    p.add_argument("--heads", default="9,3,64", help="num_heads,num_kv_heads,head_dim")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--bound",
        type=int,
        default=None,
        help="max_seq_len the heuristic sees, as in the engine's CUDA graphs (the context "
        "limit, e.g. 8192); default: each launch's real one",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes; CPU interpreter")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    heads, kv_heads, dim = common.parse_int_list(a.heads)
    batches, contexts, qs = (common.parse_int_list(x) for x in (a.batch_sizes, a.contexts, a.q))
    if a.smoke:
        batches, contexts, qs, a.repeats = [1], [40], [5], 1
    # (tile config, num_splits): None = the heuristic.
    sweep = [
        (PrefillConfig(block_m=m, block_n=n), split)
        for m, n, split in itertools.product((16, 32, 64, 128), (32, 64), (None, 1, 4, 8))
    ]
    # The decode kernel's knobs (128-key iterations, three stages) on small tiles: is the
    # gap between a few-token verify and a decode the kernel's loop or its launch shape?
    sweep += [
        (PrefillConfig(block_m=m, block_n=128, num_stages=3), split)
        for m, split in itertools.product((16, 32), (None, 4, 8))
    ]
    if a.smoke:
        sweep = sweep[:2]
    gen = torch.Generator().manual_seed(0)
    scale = dim**-0.5
    rows: list[Row] = []
    for batch, context in itertools.product(batches, contexts):
        q1, kc, vc, meta1 = make_inputs(
            batch, context, 1, heads, kv_heads, dim, device, gen, a.bound
        )
        decode_us = median_us(partial(paged_decode, q1, kc, vc, meta1, scale), device, a.repeats)
        rows.append(Row(batch, context, 1, "decode", decode_us, 1.0, 0.0))
        print(f"b{batch} ctx{context} decode {decode_us:.1f} us", flush=True)
        for q in qs:
            qt, kc, vc, meta = make_inputs(
                batch, context, q, heads, kv_heads, dim, device, gen, a.bound
            )
            ref = paged_attention_ref(qt[:q].float(), kc.float(), vc.float(), _first(meta), scale)
            default = (
                default_prefill_config(
                    q, heads // kv_heads, kc.dtype, num_seqs=batch, num_kv_heads=kv_heads,
                    num_sms=num_sms(device),
                ),
                None,
            )  # fmt: skip
            for cfg, split in [default, *[v for v in sweep if v != default]]:
                launch = partial(
                    paged_attention, qt, kc, vc, meta, scale, config=cfg, num_splits=split
                )
                err = (launch()[:q].float() - ref).abs().max().item()
                us = median_us(launch, device, a.repeats)
                split_name = "auto" if split is None else str(split)
                stages = "" if cfg.num_stages == 2 else f"/s{cfg.num_stages}"
                name = f"{cfg.block_m}/{cfg.block_n}/{split_name}{stages}" + (
                    "*" if (cfg, split) == default else ""
                )
                rows.append(Row(batch, context, q, name, us, us / decode_us, err))
            best = min((r for r in rows if r.q == q and r.batch == batch and r.context == context),
                       key=lambda r: r.us)  # fmt: skip
            print(f"b{batch} ctx{context} q{q}: best {best.config} {best.us:.1f} us "
                  f"({best.vs_decode:.2f}x decode)", flush=True)  # fmt: skip
    if a.json_path:
        Path(a.json_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print("| batch | context | q | config | µs | × decode | max err |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.batch} | {r.context} | {r.q} | {r.config} | {r.us:.1f} | "
              f"{r.vs_decode:.2f} | {r.max_err:.1e} |")  # fmt: skip


def _first(meta: AttentionMetadata) -> AttentionMetadata:
    """The first sequence of ``meta`` alone (for a cheap reference)."""
    q = int(meta.query_start_loc[1])
    t = meta.tree_lens
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[:q],
        query_start_loc=meta.query_start_loc[:2],
        seq_lens=meta.seq_lens[:1],
        block_tables=meta.block_tables[:1],
        max_query_len=q,
        max_seq_len=int(meta.seq_lens[0]),
        tree_lens=None if t is None else t[:1],
        tree_mask_offsets=None if t is None else meta.tree_mask_offsets[:1],
        tree_mask=None if t is None else meta.tree_mask[: int(t[0]) ** 2],
        max_tree_len=meta.max_tree_len,
    )


if __name__ == "__main__":
    main()
