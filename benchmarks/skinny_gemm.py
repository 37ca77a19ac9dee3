"""The skinny Triton GEMM against cuBLAS on SmolLM2-135M's projections (target and EAGLE-3
head), at the row counts decode, verify and draft steps multiply: device microseconds per
call, each measured as a CUDA graph of ``--calls`` back-to-back calls (no launch gaps from
the host, as inside the engine's graphs), median of ``--repeats`` replays.

    python benchmarks/skinny_gemm.py --rows 1,4,6,16,32,64,96 --json out/skinny_gemm.json

``--cold`` rotates each call through copies of the weight that together exceed the L2
(``--cold-mb``, default 256 MB), as a forward's 30 layers do; without it a projection's
weight stays in L2 from call to call, which flatters the Triton kernel.
``--tune`` also times a grid of tile configs at ``--tune-rows`` rows and prints the best
per shape (how ``choose_gemm_config``'s defaults are chosen); with ``--check-bits`` each
tile's output is compared bit for bit with the shape's decode tile (``gemm_tiles``) on the
same rows, and the best tile with equal bits is reported too: the tiles deterministic mode
may switch to above ``SMALL_ROWS`` or ``DECODE_ROWS`` rows. ``--write-tier batch PATH`` writes
the fastest such tile over all tuned rows per shape, for ``$SPECDEC_GEMM_TILES``:

    python benchmarks/skinny_gemm.py --cold --rows 32,64 --shapes $SHAPES --tune \
        --tune-rows 32,64 --tune-block-m 32,64 --tune-block-n 16,32,64 --tune-block-k decode \
        --tune-warps 2,4,8 --tune-stages 1,3 --check-bits --write-tier batch tiles.json

    SHAPES=add+norm+qkv,o_proj,add+norm+gate_up+silu,down,add+norm+lm_head
    python benchmarks/skinny_gemm.py --rows 64,512,2048 --shapes $SHAPES --tune \
        --tune-rows 2048 --tune-block-m 64,128 --tune-block-n 64,128 \
        --tune-block-k decode --tune-warps 4,8 --tune-stages 1,3 --check-bits

(``--tune-block-k decode``: only each shape's own decode-tile BLOCK_K.) The gate/up rows compare
cuBLAS + SiLU + multiply (three kernels, as the eager module) against the fused kernel;
the add+norm rows time the fused residual add + RMSNorm prologue against cuBLAS's
projection alone (the compiled layer's add + norm kernel not counted on that side).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_int_list

# name -> (N, K, fused gate/up, residual add + RMSNorm prologue): SmolLM2-135M (hidden
# 576, 9 + 2 x 3 heads of 64, MLP 1536, vocabulary 49,152) and its EAGLE-3 head (2H-wide
# qkv input, fc 3H -> H, 16,384 draft ids).
SHAPES = {
    "qkv": (960, 576, False, False),
    "add+norm+qkv": (960, 576, False, True),
    "o_proj": (576, 576, False, False),
    "gate_up+silu": (3072, 576, True, False),
    "add+norm+gate_up+silu": (3072, 576, True, True),
    "down": (576, 1536, False, False),
    "lm_head": (49152, 576, False, False),
    "add+norm+lm_head": (49152, 576, False, True),
    "head qkv": (960, 1152, False, False),
    "head fc": (576, 1728, False, False),
    "head lm_head": (16384, 576, False, False),
}


def time_graph(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn`` replayed as one graph of ``calls`` calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times[1:])


class Weights:
    """One weight, or copies of it handed out in turn (``--cold``): each captured call
    then reads a weight the previous calls did not."""

    def __init__(self, w: torch.Tensor, copies: int) -> None:
        self.ws = [w] + [w.clone() for _ in range(copies - 1)]
        self.i = 0

    def __call__(self) -> torch.Tensor:
        w = self.ws[self.i % len(self.ws)]
        self.i += 1
        return w


def cublas_fn(x, ws: Weights, fused: bool):
    if not fused:
        return lambda: F.linear(x, ws())

    def mlp_half():
        gate, up = F.linear(x, ws()).chunk(2, dim=-1)
        return F.silu(gate) * up

    return mlp_half


def triton_fn(x, ws: Weights, fused: bool, config=None, norm: bool = False, res=None):
    """The kernel on ``x``; with ``norm``, the add + RMSNorm prologue on ``x + res``
    (``res`` random when not given)."""
    from specdec.kernels import skinny_gemm as sg

    if norm:
        res = torch.randn_like(x) if res is None else res
        nw = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
        if fused:
            return lambda: sg.add_rmsnorm_gate_up_silu(x, res, nw, 1e-5, ws(), config)
        return lambda: sg.add_rmsnorm_linear(x, res, nw, 1e-5, ws(), None, config)
    if fused:
        return lambda: sg.gate_up_silu(x, ws(), config)
    return lambda: sg.skinny_linear(x, ws(), None, config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=parse_int_list, default=[1, 4, 6, 16, 32, 64, 96])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tune", action="store_true", help="time a grid of tile configs too")
    p.add_argument("--tune-rows", type=parse_int_list, default=[4])
    p.add_argument(
        "--tune-block-m",
        type=parse_int_list,
        default=[16],
        help="row tiles in the tuning grid (a deterministic-mode tile must serve every row "
        "count, so compare one tile's times across --tune-rows)",
    )
    p.add_argument("--tune-block-n", type=parse_int_list, default=[16, 32, 64])
    p.add_argument(
        "--tune-block-k",
        type=lambda text: [0 if v == "decode" else int(v) for v in text.split(",") if v],
        default=[64, 128, 256],
        help="'decode': the shape's decode-tile BLOCK_K",
    )
    p.add_argument("--tune-warps", type=parse_int_list, default=[2, 4])
    p.add_argument("--tune-stages", type=parse_int_list, default=[3])
    p.add_argument(
        "--check-bits",
        action="store_true",
        help="compare each tuned tile's output bits with the shape's decode tile's",
    )
    p.add_argument("--cold", action="store_true", help="weights from HBM, not L2")
    p.add_argument("--cold-mb", type=int, default=256)
    p.add_argument("--json", help="write the rows here")
    p.add_argument(
        "--write-tiles", help="write the tuned tile per (N, K) here, for $SPECDEC_GEMM_TILES"
    )
    p.add_argument(
        "--write-tier",
        nargs=2,
        metavar=("TIER", "PATH"),
        help="write the fastest tile with the decode tile's bits per (N, K) as that tier "
        "(decode, batch or prefill) for $SPECDEC_GEMM_TILES; needs --check-bits",
    )
    a = p.parse_args()
    if a.write_tier and not a.check_bits:
        p.error("--write-tier keeps only tiles with the decode tile's bits: add --check-bits")
    from specdec.kernels.skinny_gemm import GemmConfig, choose_gemm_config, gemm_tiles

    torch.manual_seed(0)
    rows_out: list[dict] = []
    names = [s for s in a.shapes.split(",") if s]
    for name in names:
        n, k, fused, norm = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        copies = 1
        if a.cold:
            copies = max(2, -(-a.cold_mb * 2**20 // (w.numel() * w.element_size())))
        ws = Weights(w, copies)
        calls = max(a.calls, copies)  # every copy read once per replay
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            one = Weights(w, 1)
            ref = cublas_fn(x, one, fused)()
            got = triton_fn(x, one, fused)()
            err = (got.float() - ref.float()).abs().max().item()  # the plain kernel's
            row = {
                "shape": name,
                "rows": m,
                "N": n,
                "K": k,
                "cold": a.cold,
                "cublas_us": time_graph(cublas_fn(x, ws, fused), calls, a.repeats),
                "triton_us": time_graph(triton_fn(x, ws, fused, None, norm), calls, a.repeats),
                "config": vars(choose_gemm_config(m, n // 2 if fused else n, k)),
                "max_abs_diff": err,
            }
            if a.tune and m in a.tune_rows:
                decode = gemm_tiles(n // 2 if fused else n, k).decode
                block_ks = sorted({bk or decode.block_k for bk in a.tune_block_k})
                grid = itertools.product(
                    a.tune_block_m, a.tune_block_n, block_ks, a.tune_warps, a.tune_stages
                )
                res = torch.randn_like(x)
                base = triton_fn(x, one, fused, decode, norm, res)()
                best, best_equal, timed = None, None, []
                for bm, bn, bk, warps, stages in grid:
                    cfg = GemmConfig(bm, bn, bk, warps, stages)
                    try:
                        us = time_graph(triton_fn(x, ws, fused, cfg, norm), calls, 5)
                        out = triton_fn(x, one, fused, cfg, norm, res)()
                    except Exception as e:  # out of shared memory / registers
                        print(f"  {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    same = _equal(out, base) if a.check_bits else None
                    timed.append({"us": us, "same_bits": same, **vars(cfg)})
                    if best is None or us < best[0]:
                        best = (us, vars(cfg))
                    if same and (best_equal is None or us < best_equal[0]):
                        best_equal = (us, vars(cfg))
                row["grid"] = timed
                if best is not None:
                    row["tuned_us"], row["tuned_config"] = best
                if best_equal is not None:
                    row["equal_us"], row["equal_config"] = best_equal
                    row["differing_tiles"] = sum(t["same_bits"] is False for t in timed)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    print(
        "| shape | rows | cuBLAS µs | Triton µs | speedup | tuned µs (config) "
        "| equal bits: µs (config), tiles differing |"
    )
    print("|---|---:|---:|---:|---:|---|---|")
    for r in rows_out:
        tuned = f"{r['tuned_us']:.2f} ({_tile(r['tuned_config'])})" if "tuned_us" in r else ""
        equal = ""
        if "equal_us" in r:
            equal = f"{r['equal_us']:.2f} ({_tile(r['equal_config'])}), {r['differing_tiles']}"
        print(
            f"| {r['shape']} | {r['rows']} | {r['cublas_us']:.2f} | {r['triton_us']:.2f} | "
            f"{r['cublas_us'] / r['triton_us']:.2f}× | {tuned} | {equal} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows_out, indent=1))
    if a.write_tiles:  # the fastest tile per (N, K) over the tuned row counts
        best: dict[str, tuple[float, dict]] = {}
        for r in rows_out:
            if "tuned_us" not in r:
                continue
            n = r["N"] // 2 if SHAPES[r["shape"]][2] else r["N"]
            key = f"{n},{r['K']}"
            if key not in best or r["tuned_us"] < best[key][0]:
                best[key] = (r["tuned_us"], r["tuned_config"])
        Path(a.write_tiles).write_text(json.dumps({k: c for k, (_, c) in best.items()}))
    if a.write_tier:  # the fastest equal-bits tile per (N, K), summed over the tuned rows
        tier, path = a.write_tier
        Path(path).write_text(json.dumps({k: {tier: c} for k, c in _tier_tiles(rows_out).items()}))


TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def _tier_tiles(rows: list[dict]) -> dict[str, dict]:
    """Per ``"N,K"``, the tile with the decode tile's bits whose times summed over the
    tuned row counts are least (a tier serves all of them); a tile that failed or differed
    at some row count is out."""
    times: dict[str, dict[tuple, list[float]]] = {}
    tuned: dict[str, int] = {}
    for r in rows:
        if "grid" not in r:
            continue
        key = f"{r['N'] // 2 if SHAPES[r['shape']][2] else r['N']},{r['K']}"
        tuned[key] = tuned.get(key, 0) + 1
        for t in r["grid"]:
            if t["same_bits"]:
                times.setdefault(key, {}).setdefault(tuple(t[f] for f in TILE_FIELDS), [])
                times[key][tuple(t[f] for f in TILE_FIELDS)].append(t["us"])
    out = {}
    for key, by_tile in times.items():
        full = {tile: sum(us) for tile, us in by_tile.items() if len(us) == tuned[key]}
        if full:
            out[key] = dict(zip(TILE_FIELDS, min(full, key=full.get), strict=True))
    return out


def _tile(c: dict) -> str:
    return f"m{c['block_m']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}"


def _equal(a, b) -> bool:
    """Bitwise equality of a kernel's outputs (a tensor, or the (out, stream) pair)."""
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


if __name__ == "__main__":
    main()
