"""GEMMs of a few token rows against a weight (``x @ W.T``), in Triton, next to their
PyTorch references.

A decode or verify step of a small model multiplies 1-96 token rows by each projection.
That is a weight read, ~1-3.5 MB per projection of SmolLM2-135M (well under a
microsecond of the H200's bandwidth), yet cuBLAS took 3.0-5.1 µs per projection
on the H200: its kernels tile the token dimension for large batches and
spread a skinny product over few thread blocks. Here every program owns ``BLOCK_N``
output columns of up to ``BLOCK_M`` rows and reads its slice of the weight once, so even
a 576-column projection runs ~36 programs at once and a 49,152-row LM head ~770.

Measured on the H200 (docs/benchmarks.md, "Kernel micro-benchmarks"): with a weight
resident in L2 (the same projection called back to back) it beats cuBLAS at 1-16 rows (qkv
2.7 against 3.5 µs, gate/up + SiLU 3.5 against 8.2); inside the engine, where 30 layers'
weights stream from HBM, SmolLM2's decode step is slower with it (TPOT 1.10 ms against
0.97 at batch 1), so the engine leaves it off unless asked
(``EngineConfig.triton_gemm_max_tokens``).

``gate_up_silu`` fuses the MLP's first half: ``silu(x @ gate.T) * (x @ up.T)`` from the
fused ``gate_up`` weight (gate rows first), one launch and no ``[rows, 2 * I]`` round
trip through memory. Its roundings follow the unfused modules (each product rounded to
the activation dtype, SiLU computed in float32 and rounded, then the product).
``add_rmsnorm_linear`` and ``add_rmsnorm_gate_up_silu`` also take a pre-norm block's
entry into the prologue: the residual add and the RMSNorm (each program computes its
rows' RMS over K first, then normalises as it loads; the first column tile writes the
stream), with ``models.llama.RMSNorm``'s roundings.

Invariants: float32 accumulation over a ``BLOCK_K`` loop whose tiles depend on the
weight's shape only, never on the number of rows. Shapes come from host ints, nothing
synchronises (graph-safe).

Batch invariance, for any number of rows (1 to a prefill's thousands): a row's output
bits depend on that row and the weight only, never on how many rows the launch has, where
the row sits among them or what the other rows hold. No split-K: each output element is
one program's ``BLOCK_K`` loop, in order; rows sharing a tile never mix (masked rows load
zeros and are not stored). ``BLOCK_K`` is therefore the one tile field a row's bits depend
on, and ``choose_gemm_config`` takes it from the weight's shape (N, K) alone: one per
shape (``GemmTiles``). The row and column tiles, warps and stages only decide which
program computes an element, not its bits (checked below), so launches of a few rows run
a tile sized for decode steps, up to ``DECODE_ROWS`` rows one sized for batched decode
and verify steps, and larger ones (prefill chunks) a tile sized for many rows, all with
the same ``BLOCK_K``: a row's bits are those of every other launch. Checked bitwise on
an H100 (bf16, SmolLM2's five projections, 2,048 rows against one): 18 row x column x
warp tiles per projection, every one equal. The norm prologue reduces each row over the
same ``BLOCK_K`` tiles, per row. The engine's deterministic mode
(``EngineConfig.deterministic``, ``models/invariant.py``) runs every target
projection here for that reason.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.kernels.launch import (
    dot_precision,
    require_grid_yz,
    require_last_dim_contiguous,
    require_launchable,
)

__all__ = [
    "DECODE_ROWS",
    "SMALL_ROWS",
    "TIERS",
    "GemmConfig",
    "GemmTiles",
    "add_rmsnorm_gate_up_silu",
    "add_rmsnorm_gate_up_silu_ref",
    "add_rmsnorm_linear",
    "add_rmsnorm_linear_ref",
    "choose_gemm_config",
    "gate_up_silu",
    "gate_up_silu_ref",
    "gemm_tiles",
    "skinny_linear",
    "skinny_linear_ref",
]


@triton.jit(do_not_specialize=["M"])  # one compilation per tile, whatever the rows
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    res_ptr,  # [M, K] (ADD) or a dummy
    nw_ptr,  # [K] RMSNorm weight (NORM) or a dummy
    stream_ptr,  # out [M, K]: x + residual (ADD; written by the first column tile)
    w_ptr,  # [N, K] (SILU_MUL: [2 * N, K], gate rows then up rows)
    b_ptr,  # [N] or a dummy (HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    eps,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    row_off = rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]; residual, stream alike
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    in_ty = x_ptr.dtype.element_ty
    if NORM:
        # The rows' RMS over all K first (every program reads its rows whole: K is a few
        # hundred values, the weight slice is what costs).
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            mk = m_ok[:, None] & (k < K)[None, :]
            s = tl.load(x_ptr + row_off + k[None, :], mask=mk, other=0.0)
            if ADD:
                r = tl.load(res_ptr + row_off + k[None, :], mask=mk, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(in_ty)
                if pid_n == 0:
                    tl.store(stream_ptr + row_off + k[None, :], s, mask=mk)
            s32 = s.to(tl.float32)
            sq += tl.sum(s32 * s32, axis=1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        mk = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + row_off + k[None, :], mask=mk, other=0.0)
        if NORM:  # RMSNorm's roundings: the sum, the normed row, then the weight's product
            if ADD:
                r = tl.load(res_ptr + row_off + k[None, :], mask=mk, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)
            x = (x.to(tl.float32) * rstd[:, None]).to(in_ty)
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (nw[None, :] * x.to(tl.float32)).to(in_ty)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_cols + k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if SILU_MUL:
            up = tl.load(w_cols + N * stride_wn + k[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, up, acc_up, input_precision=PRECISION)
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
        res = (act * acc_up.to(out_ty).to(tl.float32)).to(out_ty)
    else:
        res = acc.to(out_ty)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, res, mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one launch. ``block_k`` depends on the weight's shape only, never on
    the number of rows, so the rows' results do not either (``GemmTiles``)."""

    block_m: int = 16  # tl.dot's smallest tile; 1-16 rows are one row tile
    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


SMALL_ROWS = 16
"""Launches of at most this many rows (batch-1 and small-batch decode steps) run a shape's
decode tile; up to ``DECODE_ROWS`` its batch tile where it has one (``GemmTiles``)."""

DECODE_ROWS = 64
"""Launches of at most this many rows run a shape's decode (or batch) tile, larger ones its
prefill tile (``GemmTiles``)."""

TIERS = ("decode", "batch", "prefill")
"""The tiles of one shape, by launch size: ``decode`` up to ``SMALL_ROWS`` rows, ``batch``
up to ``DECODE_ROWS`` (the decode tile where a shape has none), ``prefill`` above."""


@dataclass(frozen=True)
class GemmTiles:
    """The tiles of one weight shape: ``decode`` for launches of at most ``SMALL_ROWS``
    rows, ``batch`` (optional) up to ``DECODE_ROWS`` rows (a batch-64 decode step, a
    32-node verify tree), where another row or column tile beats the decode tile (the LM
    head's: its 32-column decode tile repeats the norm prologue in twice as many column
    tiles), ``prefill`` above. Invariant: all have one ``block_k``, the only tile field a
    row's bits depend on (module docstring), so switching between them changes no bit."""

    decode: GemmConfig
    prefill: GemmConfig
    batch: GemmConfig | None = None

    def __post_init__(self) -> None:
        for name in ("prefill", "batch"):
            tile = getattr(self, name)
            if tile is not None and tile.block_k != self.decode.block_k:
                raise ValueError(
                    f"decode tile block_k={self.decode.block_k} and {name} tile "
                    f"block_k={tile.block_k} differ: a row's bits would depend on the "
                    "launch's row count; give every tile of a shape one block_k"
                )

    @classmethod
    def one(cls, tile: GemmConfig) -> GemmTiles:
        """One tile for every row count."""
        return cls(tile, tile)

    def for_rows(self, num_rows: int) -> GemmConfig:
        if num_rows <= SMALL_ROWS:
            return self.decode
        if num_rows <= DECODE_ROWS:
            return self.batch or self.decode
        return self.prefill

    def replace(self, **tiles: GemmConfig) -> GemmTiles:
        """These tiles with some tiers replaced (``TIERS`` names)."""
        return GemmTiles(**{name: tiles.get(name, getattr(self, name)) for name in TIERS})


TILES_ENV = "SPECDEC_GEMM_TILES"
"""A JSON file of measured tiles, consulted before ``MEASURED_TILES``: for tuning
experiments on a GPU, never needed for correctness. Per ``"N,K"``, either one tile's
``GemmConfig`` fields (one tile for every row count, what ``benchmarks/skinny_gemm.py
--tune --write-tiles`` writes) or a map from tier names (``TIERS``) to fields, where the
tiers it leaves out keep the shape's measured (or rule) tiles (what ``--write-tier``
writes)."""


@functools.cache
def _measured_tiles(path: str) -> dict[tuple[int, int], GemmTiles]:
    data = json.loads(Path(path).read_text())
    out = {}
    for key, fields in data.items():
        n, k = (int(v) for v in key.split(","))
        if set(fields) <= set(TIERS):
            tiles = {name: GemmConfig(**f) for name, f in fields.items()}
            out[n, k] = _default_tiles(n, k).replace(**tiles)
        else:
            out[n, k] = GemmTiles.one(GemmConfig(**fields))
    return out


# Tiles measured per (N, K) on an H100 (bf16): SmolLM2-135M's projections. Decode tiles:
# weights streamed from HBM as in a forward (``benchmarks/skinny_gemm.py --cold --rows
# 1,64,2048 --tune --tune-rows 1,64,2048 --tune-block-m 16,64``, docs/benchmarks.md), the
# least time at 1 + 64 rows (the LM head's batch tile: at 32 + 64 rows). Prefill tiles:
# the same BLOCK_K, among the fastest at 512 and 2,048 rows with bits equal to the decode
# tile's (``--tune --check-bits``, the command and table in docs/benchmarks.md); a stage
# count of 1 where 3 does not fit in shared memory.
MEASURED_TILES: dict[tuple[int, int], GemmTiles] = {
    (960, 576): GemmTiles(  # qkv
        GemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4),
        GemmConfig(block_m=64, block_n=128, block_k=256, num_warps=8, num_stages=1),
        # 17-64 rows: 5.8 / 5.8 µs at 32 / 64 rows against the decode tile's 5.8 / 6.1
        # (a grid of 16- and 32-row tiles, same command as the LM head's below)
        GemmConfig(block_m=16, block_n=32, block_k=256, num_warps=4),
    ),
    (576, 576): GemmTiles(  # o_proj
        GemmConfig(block_m=64, block_n=16, block_k=128, num_warps=4),
        GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4),
    ),
    (1536, 576): GemmTiles(  # gate/up
        GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=2),
        GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=1),
    ),
    (576, 1536): GemmTiles(  # down
        GemmConfig(block_m=16, block_n=16, block_k=256, num_warps=2),
        GemmConfig(block_m=64, block_n=64, block_k=256, num_warps=4),
    ),
    (49152, 576): GemmTiles(  # LM head
        GemmConfig(block_m=64, block_n=32, block_k=64, num_warps=4),
        GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8),
        # 17-64 rows (a verify tree, a batch-64 step): 29 / 36 µs at 32 / 64 rows against
        # the decode tile's 54 / 58 (`--cold --tune-rows 32,64 --tune-block-k decode
        # --check-bits --write-tier batch`, docs/benchmarks.md); o_proj, gate/up and down
        # keep their decode tiles, ahead of or level with every 32- and 64-row tile tried.
        GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4),
    ),
}


def gemm_tiles(n: int, k: int) -> GemmTiles:
    """The tiles of an ``[n, k]`` weight: ``$SPECDEC_GEMM_TILES`` first, then
    ``MEASURED_TILES``, else the rule (one tile): narrow column tiles for narrow
    projections (enough programs to fill the SMs with a 576-column output), wider ones for
    wide outputs (an LM head: fewer, longer programs)."""
    path = os.environ.get(TILES_ENV)
    if path:
        tiles = _measured_tiles(path).get((n, k))
        if tiles is not None:
            return tiles
    return _default_tiles(n, k)


def _default_tiles(n: int, k: int) -> GemmTiles:
    tiles = MEASURED_TILES.get((n, k))
    if tiles is not None:
        return tiles
    return GemmTiles.one(GemmConfig(block_n=16 if n <= 4096 else 64))


def choose_gemm_config(num_rows: int, n: int, k: int) -> GemmConfig:
    """The tile of a launch of ``num_rows`` rows against an ``[n, k]`` weight
    (``gemm_tiles(n, k).for_rows``): its ``block_k`` depends on ``(n, k)`` alone (batch
    invariance, module docstring)."""
    return gemm_tiles(n, k).for_rows(num_rows)


@dataclass(frozen=True)
class _Norm:
    """The RMSNorm in front of a projection: ``weight * rmsnorm(x + residual)``."""

    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None  # [rows, K]; None: no add


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    silu_mul: bool,
    config: GemmConfig | None,
    norm: _Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out [rows, n], the stream (norm.residual)
    require_launchable(_skinny_gemm_kernel, x, weight)
    require_last_dim_contiguous("x", x)
    require_last_dim_contiguous("weight", weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [rows, K] and "
            "[N, K] with the same K"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}; cast one of them")
    m, k = x.shape
    residual = norm.residual if norm is not None else None
    stream = None
    if norm is not None:
        if norm.weight.shape != (k,):
            raise ValueError(f"norm weight {tuple(norm.weight.shape)} must be [{k}]")
        if residual is not None:
            if residual.shape != x.shape or residual.stride() != x.stride():
                raise ValueError(
                    f"residual {tuple(residual.shape)} (strides {residual.stride()}) must "
                    f"match x {tuple(x.shape)} (strides {x.stride()})"
                )
            stream = torch.empty_like(x)
    cfg = config or choose_gemm_config(m, n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out, stream
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    require_grid_yz("row tiles (rows / block_m)", grid[1])
    _skinny_gemm_kernel[grid](
        x,
        residual if residual is not None else x,
        norm.weight if norm is not None else x,
        stream if stream is not None else x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        norm.eps if norm is not None else 0.0,
        NORM=norm is not None,
        ADD=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, stream


def skinny_linear(
    x: torch.Tensor,  # [rows, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [rows, N]
    """``F.linear(x, weight, bias)`` for a few rows (float32 accumulation)."""
    return _launch(x, weight, bias, weight.shape[0], False, config)[0]


def gate_up_silu(
    x: torch.Tensor,  # [rows, K]
    weight: torch.Tensor,  # [2 * I, K]: gate rows, then up rows
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [rows, I]
    """``silu(gate) * up`` of ``x @ weight.T`` split in halves, in one launch."""
    if weight.shape[0] % 2:
        raise ValueError(f"gate_up weight has {weight.shape[0]} rows; expected 2 * I")
    return _launch(x, weight, None, weight.shape[0] // 2, True, config)[0]


def add_rmsnorm_linear(
    x: torch.Tensor,  # [rows, K]
    residual: torch.Tensor | None,  # [rows, K]; None: x is the stream
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, N], the stream [rows, K]
    """A pre-norm block's entry in one launch: ``stream = x + residual``, then
    ``F.linear(norm_weight * rmsnorm(stream), weight, bias)``. Returns both (the stream
    is ``x`` itself without a residual)."""
    norm = _Norm(norm_weight, eps, residual)
    out, stream = _launch(x, weight, bias, weight.shape[0], False, config, norm)
    return out, x if stream is None else stream


def add_rmsnorm_gate_up_silu(
    x: torch.Tensor,  # [rows, K]
    residual: torch.Tensor | None,  # [rows, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2 * I, K]
    config: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, I], the stream [rows, K]
    """The MLP's entry in one launch: the stream, its RMSNorm, gate/up and SiLU."""
    if weight.shape[0] % 2:
        raise ValueError(f"gate_up weight has {weight.shape[0]} rows; expected 2 * I")
    norm = _Norm(norm_weight, eps, residual)
    out, stream = _launch(x, weight, None, weight.shape[0] // 2, True, config, norm)
    return out, x if stream is None else stream


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def gate_up_silu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def _rmsnorm_ref(stream: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = stream.float()  # models.llama.RMSNorm's order
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(stream.dtype)


def add_rmsnorm_linear_ref(x, residual, norm_weight, eps, weight, bias=None):
    stream = x if residual is None else x + residual
    return F.linear(_rmsnorm_ref(stream, norm_weight, eps), weight, bias), stream


def add_rmsnorm_gate_up_silu_ref(x, residual, norm_weight, eps, weight):
    stream = x if residual is None else x + residual
    return gate_up_silu_ref(_rmsnorm_ref(stream, norm_weight, eps), weight), stream
