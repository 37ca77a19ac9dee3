"""Attention of a block drafter's block tokens (``specdec.models.block_drafter``), next to
its PyTorch reference (``ops.block_attention``).

A block at root position ``r`` holds ``B`` tokens at positions ``r .. r + B - 1``. Each
block token attends to the request's context, the drafter's K/V of positions ``0 .. r-1``
(written once per position into paged blocks that mirror the target's: ``slot =
block_table[p // page_size] * page_size + p % page_size``), and to all ``B`` keys of its
own block, both ways. No key is masked by position beyond that: every block token sees
the same ``r + B`` keys.

* One program per (KV head, request). Its rows are the block's ``B`` tokens times the
  ``GROUP`` query heads that share the KV head (padded to a power of two >= 16 for
  ``tl.dot``), so every K/V tile it loads serves the whole block.
* Context keys stream through ``BLOCK_N``-key tiles read through the block table, then the
  block's own keys come as one tile from the dense ``k``/``v`` of the step: block
  positions are never written to the cache (rejected drafts leave nothing stale).
* fp32 online softmax in log2 units, one pass, no split: a drafter's context tiles are
  few enough per program that the block's rows keep the SMs busy.
* The grid is (KV heads, requests); shapes come from host ints and nothing synchronises,
  so the launch can be captured in a CUDA graph. Context lengths are read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import (
    dot_precision,
    gqa_group,
    next_power_of_2,
    require_grid_yz,
    require_last_dim_contiguous,
    require_launchable,
)
from specdec.ops.block_attention import block_attention_ref

__all__ = ["BLOCK_N", "block_attention", "block_attention_ref"]

BLOCK_N = 64  # context keys per loop iteration
# Finite stand-in for -inf as the running max's start: exp2(-inf - -inf) would be NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(
    q,  # [ROWS, BLOCK_D]
    k,  # [KEYS, BLOCK_D]: zeros where not valid
    v,  # [KEYS, BLOCK_D]
    valid,  # [KEYS]: the keys every row attends to
    m,  # [ROWS] running max, log2 units (finite start)
    l_i,  # [ROWS] running sum
    acc,  # [ROWS, BLOCK_D] running weighted sum of V
    scale_log2,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of keys folded into every row's online softmax (each tile holds at least
    one valid key, so the new max is finite)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))  # [ROWS, KEYS]
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _block_attention_kernel(
    q_ptr,  # [num_blocks * B, num_heads, head_dim]
    k_ptr,  # [num_blocks * B, num_kv_heads, head_dim]: the blocks' own keys
    v_ptr,
    k_cache_ptr,  # [num_slots, num_kv_heads, head_dim]: context keys by cache slot
    v_cache_ptr,
    tables_ptr,  # [num_blocks, table_width] page ids
    context_lens_ptr,  # [num_blocks]
    out_ptr,  # [num_blocks * B, num_heads, head_dim]
    scale_log2,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_om,
    stride_oh,
    BLOCK: tl.constexpr,  # B: tokens per block
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # >= BLOCK * GROUP, a power of two >= 16
    BLOCK_B: tl.constexpr,  # >= BLOCK, a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kvh = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    tok = offs_r // GROUP  # [ROWS]: the row's block token
    head = kvh * GROUP + offs_r % GROUP  # [ROWS]: its query head
    r_mask = tok < BLOCK
    rows = req * BLOCK + tok
    q = tl.load(
        q_ptr + rows[:, None] * stride_qm + head[:, None] * stride_qh + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [ROWS, BLOCK_D]
    m = tl.full([ROWS], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)

    context_len = tl.load(context_lens_ptr + req)
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        n_mask = pos < context_len
        page = tl.load(tables_ptr + req * stride_bt + pos // PAGE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        at = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        k = tl.load(k_cache_ptr + at, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + at, mask=kv_mask, other=0.0)
        m, l_i, acc = _online_softmax_step(q, k, v, n_mask, m, l_i, acc, scale_log2, DOT_PRECISION)

    # The block's own keys: one tile, every one visible to every block token.
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < BLOCK
    kv_mask = b_mask[:, None] & d_mask[None, :]
    brow = req * BLOCK + offs_b
    kb = tl.load(
        k_ptr + brow[:, None] * stride_km + kvh * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [BLOCK_B, BLOCK_D]
    vb = tl.load(
        v_ptr + brow[:, None] * stride_vm + kvh * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    m, l_i, acc = _online_softmax_step(q, kb, vb, b_mask, m, l_i, acc, scale_log2, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_om + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def block_attention(
    q: torch.Tensor,  # [num_blocks * B, num_heads, head_dim]
    k: torch.Tensor,  # [num_blocks * B, num_kv_heads, head_dim]: the blocks' own keys
    v: torch.Tensor,  # [num_blocks * B, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]: context keys by slot
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_blocks, table_width] int: each request's pages
    context_lens: torch.Tensor,  # [num_blocks] int: context positions 0 .. r - 1 per block
    *,
    block_size: int,  # B
    page_size: int,  # the cache's positions per page
    scale: float,
) -> torch.Tensor:  # [num_blocks * B, num_heads, head_dim], q's dtype
    """Each block token's attention over its request's paged context and its whole block
    (module docstring); the same function as ``block_attention_ref``. The block tables
    must cover every context position (``context_lens``); entries past them are not read."""
    require_launchable(_block_attention_kernel, q, k, v, k_cache, block_tables, context_lens)
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_last_dim_contiguous(name, t)
    require_last_dim_contiguous("block_tables", block_tables)
    rows, num_heads, head_dim = q.shape
    num_blocks = context_lens.shape[0]
    num_kv_heads = k_cache.shape[1]
    if rows != num_blocks * block_size or k.shape != (rows, num_kv_heads, head_dim):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must hold {num_blocks} blocks of "
            f"block_size={block_size} rows ([{num_blocks * block_size}, heads, {head_dim}])"
        )
    if v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v {tuple(v.shape)} and v_cache {tuple(v_cache.shape)} must match k "
            f"{tuple(k.shape)} and k_cache {tuple(k_cache.shape)}"
        )
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout (strides)")
    if k_cache.shape[1:] != (num_kv_heads, head_dim) or block_tables.shape[0] != num_blocks:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} must be [slots, {num_kv_heads}, {head_dim}] and "
            f"block_tables {tuple(block_tables.shape)} must have {num_blocks} rows"
        )
    group = gqa_group(num_heads, num_kv_heads)
    require_grid_yz("num_blocks", num_blocks)
    out = torch.empty_like(q)
    if num_blocks == 0:
        return out
    _block_attention_kernel[(num_kv_heads, num_blocks)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK=block_size,
        GROUP=group,
        ROWS=max(16, next_power_of_2(block_size * group)),
        BLOCK_B=max(16, next_power_of_2(block_size)),
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        PAGE=page_size,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(k_cache.dtype),
    )
    return out
