"""RMSNorm, with the residual add in front of it, in Triton (one program per row), next to
its PyTorch reference.

Batch invariance: a row's result depends on that row alone. Each program reads its row
whole as one ``BLOCK_K = next_power_of_2(K)`` block and sums the squares in float32 with
one ``tl.sum``, whose order is set by ``BLOCK_K`` and ``num_warps``, both functions of
``K`` only; so a row gives the same bits whatever the number of rows in the launch, its
position among them and the rows around it. (torch's mean over the last dim picks its
reduction strategy from the whole tensor's shape: no such guarantee.)

Roundings follow ``models.llama.RMSNorm`` (HF's order): the stream ``x + residual``
rounded to the activation dtype; the square sum, the mean and ``1 / sqrt`` in float32;
the normed row rounded to the activation dtype; then ``weight * row`` in float32, rounded
to torch's promotion of the two dtypes (bf16 * bf16: bf16).

Shapes come from host ints; nothing synchronises (graph-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import require_launchable

__all__ = ["add_rmsnorm", "add_rmsnorm_ref", "rmsnorm", "rmsnorm_ref", "rmsnorm_warps"]


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [rows, K]
    res_ptr,  # [rows, K] (ADD) or a dummy
    stream_ptr,  # out [rows, K]: x + residual (ADD) or a dummy
    w_ptr,  # [K]
    out_ptr,  # [rows, K]
    K,
    stride_x,
    stride_r,
    stride_s,
    stride_o,
    eps,
    ADD: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    in_ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + k, mask=ok, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + k, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)
        tl.store(stream_ptr + row * stride_s + k, x, mask=ok)
    x32 = x.to(tl.float32)  # masked lanes are 0: they add nothing to the sum
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / K + eps)
    normed = (x32 * rstd).to(in_ty).to(tl.float32)
    w = tl.load(w_ptr + k, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + k, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rmsnorm_warps(block_k: int) -> int:
    """Warps of a row's program: a function of the block (so of K) only."""
    return 4 if block_k <= 2048 else 8


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:  # [rows, K], last dim dense
    rows = t.reshape(-1, k)  # a view where the layout allows, else a (bit-exact) copy
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def add_rmsnorm(
    x: torch.Tensor,  # [..., K]
    residual: torch.Tensor | None,  # x's shape; None: x is the stream
    weight: torch.Tensor,  # [K]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weight * rmsnorm(stream) [..., K], stream [..., K])
    """``stream = x + residual``, then ``weight * rmsnorm(stream)``; both come back (the
    stream is ``x`` itself without a residual)."""
    k = x.shape[-1]
    if weight.shape != (k,):
        raise ValueError(f"norm weight {tuple(weight.shape)} must be [{k}] for x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    require_launchable(_rmsnorm_kernel, x, weight)
    xs = _rows(x, k)
    rs = _rows(residual, k) if residual is not None else None
    out = torch.empty(xs.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    stream = torch.empty_like(xs) if rs is not None else None
    num_rows = xs.shape[0]
    if num_rows:
        block_k = triton.next_power_of_2(k)
        _rmsnorm_kernel[(num_rows,)](
            xs,
            rs if rs is not None else xs,
            stream if stream is not None else xs,
            weight,
            out,
            k,
            xs.stride(0),
            rs.stride(0) if rs is not None else 0,
            stream.stride(0) if stream is not None else 0,
            out.stride(0),
            eps,
            ADD=rs is not None,
            BLOCK_K=block_k,
            num_warps=rmsnorm_warps(block_k),
        )
    out = out.view(*x.shape[:-1], k)
    return out, x if stream is None else stream.view(x.shape)


def rmsnorm(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [K]
    eps: float,
) -> torch.Tensor:  # [..., K]
    """``weight * rmsnorm(x)``, ``models.llama.RMSNorm``'s roundings."""
    return add_rmsnorm(x, None, weight, eps)[0]


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # models.llama.RMSNorm's order
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    stream = x if residual is None else x + residual
    return rmsnorm_ref(stream, weight, eps), stream
