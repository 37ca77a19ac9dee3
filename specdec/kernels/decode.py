"""Decode attention over the paged KV cache (Triton), next to its PyTorch reference.

Decode is one query per sequence, so the work is reading the cache: the kernel is
bandwidth-bound and is shaped to read each K/V byte once.

* One program per (KV head, sequence, split). It holds all ``group`` query heads that share
  the KV head as the rows of one tile, padded to 16 rows because ``tl.dot`` needs tile dims
  >= 16; every K/V tile it loads serves the whole group.
* Split-K (flash-decoding): a context is cut into ``num_splits`` splits so a small batch
  still fills the GPU. The host picks ``num_splits`` from the bound ``meta.max_seq_len``;
  each sequence's split length is computed in the kernel from its real length
  (``cdiv(seq_len, num_splits)`` rounded up to ``block_n``), so a CUDA graph captured at
  the longest context still spreads a short one over all its splits. Each split leaves
  its unnormalised partial ``(m, l, acc)`` (running max in log2 units, sum of
  ``2**(s - m)``, weighted sum of V); a second kernel combines a sequence's partials. With
  one split the first kernel normalises and writes the output itself.
* The grid depends only on tensor shapes and host bounds; splits past a sequence's real
  length exit at once and the combine step reads only the splits that ran. Nothing syncs
  with the host, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import (
    RUNTIME_INTS,
    dot_precision,
    gqa_group,
    next_power_of_2,
    plan_splits,
    require_grid_yz,
    require_kv_cache,
    require_last_dim_contiguous,
    require_launchable,
)
from specdec.kernels.split_k import merge_partial
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import paged_decode_ref

__all__ = [
    "DecodeConfig",
    "default_decode_config",
    "paged_decode",
    "paged_decode_ref",
]

# Finite stand-in for -inf as the running max's start: exp2(-inf - -inf) would be NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and launch knobs of the split kernel."""

    block_n: int  # keys per loop iteration; several pages so each iteration moves enough bytes
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n {self.block_n} must be a power of two >= 16 (tl.dot)")


def default_decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """128 keys (8 pages of 16) per iteration when a key row is <= 128 bytes (head_dim 64 in
    bf16), else 64: the K+V tile of one iteration stays at 32 KB. Bigger fp32 tiles spill
    registers (fp32 dots run on FMA units)."""
    row_bytes = head_dim * dtype.itemsize
    return DecodeConfig(block_n=128 if row_bytes <= 128 else 64)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale_log2,
    num_splits,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kvh = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    if start >= seq_len:
        return
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [BLOCK_G]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] absolute key positions
        n_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_off = row[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials are [num_seqs, num_splits, num_heads, (HEAD_DIM | 2)], contiguous.
        part = (seq * num_splits + split) * NUM_HEADS + heads  # [BLOCK_G]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _decode_combine_kernel(
    seq_lens_ptr,
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    kvh = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # as the kernel's
    ran = tl.cdiv(seq_len, split_len)  # splits that wrote partials (the rest exited early)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    heads = kvh * GROUP + offs_g
    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in range(0, ran):
        part = (seq * num_splits + split) * NUM_HEADS + heads
        m_s = tl.load(part_ml_ptr + part * 2, mask=g_mask, other=_NEG_BIG)
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=g_mask, other=0.0)
        a_s = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0
        )
        m_i, l_i, acc = merge_partial(m_i, l_i, acc, m_s, l_s, a_s)
    # l_i is 0 only if no split ran (seq_len 0, outside the contract): write 0, not NaN.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def paged_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    split_size: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q's dtype
    """Attention of each sequence's single new token over its whole paged context.

    Same contract and result as ``paged_decode_ref``. ``split_size`` overrides the split
    heuristic: ``cdiv(meta.max_seq_len, split_size)`` splits (each sequence then splits
    its own length that many ways); tests use it to force many splits.
    """
    require_kv_cache(k_cache, v_cache)
    require_launchable(_decode_split_kernel, q, k_cache, meta.seq_lens, meta.block_tables)
    require_last_dim_contiguous("q", q)
    require_last_dim_contiguous("block_tables", meta.block_tables)
    require_last_dim_contiguous("seq_lens", meta.seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_seqs != meta.num_seqs:
        raise ValueError(
            f"q {tuple(q.shape)} must be [num_seqs={meta.num_seqs}, num_heads, "
            f"{cache_head_dim}] for decode (one token per sequence)"
        )
    group = gqa_group(num_heads, num_kv_heads)
    config = config or default_decode_config(head_dim, k_cache.dtype)
    plan = plan_splits(
        num_seqs * num_kv_heads, meta.max_seq_len, config.block_n, q.device, split_size
    )
    require_grid_yz("num_seqs", num_seqs)
    require_grid_yz("num_splits", plan.num_splits)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out

    single = plan.num_splits == 1
    if single:  # the split kernel normalises and writes `out` itself; no scratch needed
        part_acc = part_ml = out
    else:
        part_acc = torch.empty(  # [num_seqs, num_splits, num_heads, head_dim]
            (num_seqs, plan.num_splits, num_heads, head_dim),
            dtype=torch.float32,
            device=q.device,
        )
        part_ml = torch.empty(  # [num_seqs, num_splits, num_heads, 2]: (m, l)
            (num_seqs, plan.num_splits, num_heads, 2), dtype=torch.float32, device=q.device
        )
    block_d = next_power_of_2(head_dim)
    # KV heads vary fastest in launch order so the programs reading one page's heads run
    # together and fetch the page's bytes (all heads interleaved per token) as one stretch.
    _decode_split_kernel[(num_kv_heads, num_seqs, plan.num_splits)](
        q,
        k_cache,
        v_cache,
        meta.seq_lens,
        meta.block_tables,
        out,
        part_acc,
        part_ml,
        scale * _LOG2E,
        plan.num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not single:
        _decode_combine_kernel[(num_kv_heads, num_seqs)](
            meta.seq_lens,
            part_acc,
            part_ml,
            out,
            plan.num_splits,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_G=next_power_of_2(group),
            BLOCK_D=block_d,
            BLOCK_N=config.block_n,
        )
    return out
