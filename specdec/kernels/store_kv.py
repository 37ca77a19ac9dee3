"""Write new tokens' K/V into the paged cache (Triton), next to the PyTorch references.

Token ``t`` goes to slot ``slot_mapping[t]`` (slot = block * block_size + offset, see
``specdec.ops.attention_metadata``). Padded tokens carry slots inside the null block 0, so the
kernels need no sentinel test and launch a fixed grid of one program per token.

``rope_store_kvcache`` also applies RoPE on the way: it rotates q and k (HF's "half"
layout, ``specdec.ops.rope.apply_rotary``) in float32, writes the rotated q to a new
tensor and the rotated k with v to the cache. A decode step is launch-bound on the GPU, so
folding the rotation into the cache write saves one kernel per layer per forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import (
    next_power_of_2,
    require_kv_cache,
    require_last_dim_contiguous,
    require_launchable,
)
from specdec.ops.paged_attention import rope_store_kvcache_ref, store_kvcache_ref

__all__ = ["rope_store_kvcache", "rope_store_kvcache_ref", "store_kvcache", "store_kvcache_ref"]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    # int64: a multi-GB cache has more elements than int32 can address.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = slot * stride_cache_slot + offs_h[:, None] * stride_cache_h + offs_d[None, :]

    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K/V into its cache slot, casting to the cache dtype.

    ``k``/``v`` may be strided views (e.g. slices of a fused QKV projection) as long as the
    head dim is contiguous. Slots must be distinct except inside the null block.
    """
    require_kv_cache(k_cache, v_cache)
    require_launchable(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [num_tokens, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")
    require_last_dim_contiguous("k", k)
    require_last_dim_contiguous("v", v)
    # Slots are read densely (slot_mapping[token]); a strided view would address others.
    require_last_dim_contiguous("slot_mapping", slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )


@triton.jit
def _rotate_half_pair(x1, x2, cos, sin):
    """(x1, x2) -> the two halves of RoPE's rotation, in float32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    stride_cache_slot,
    stride_cache_h,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    cos = tl.load(cos_ptr + tok * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]

    # q: every head of the token at once, rotated into the contiguous output.
    offs_qh = tl.arange(0, BLOCK_QH)
    q_mask = (offs_qh[:, None] < NUM_HEADS) & d_ok[None, :]
    src = q_ptr + tok * stride_qt + offs_qh[:, None] * stride_qh + offs_d[None, :]
    q1, q2 = _rotate_half_pair(
        tl.load(src, mask=q_mask), tl.load(src + HALF, mask=q_mask), cos, sin
    )
    dst = q_out_ptr + tok * stride_ot + offs_qh[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # k rotated and v as is, into the token's cache slot.
    # int64: a multi-GB cache has more elements than int32 can address.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    kv_mask = (offs_h[:, None] < NUM_KV_HEADS) & d_ok[None, :]
    src = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    k1, k2 = _rotate_half_pair(
        tl.load(src, mask=kv_mask), tl.load(src + HALF, mask=kv_mask), cos, sin
    )
    dst = slot * stride_cache_slot + offs_h[:, None] * stride_cache_h + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    src = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v1 = tl.load(src, mask=kv_mask)
    v2 = tl.load(src + HALF, mask=kv_mask)
    tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_store_kvcache(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] q after RoPE, contiguous
    """Rotate q and k, write rotated k and v into each token's cache slot; returns the
    rotated q (``rope_store_kvcache_ref``'s results, with the rotation in float32 rounded
    once to q's dtype, as a compiled RoPE computes it).

    ``q``/``k``/``v`` may be strided views (slices of a fused QKV projection) as long as
    the head dim is contiguous. Slots must be distinct except inside the null block.
    """
    require_kv_cache(k_cache, v_cache)
    require_launchable(_rope_store_kv_kernel, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or k.shape[0] != num_tokens:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{num_tokens}, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] to match q and the cache"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd; RoPE rotates two equal halves")
    half = head_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, 1, half):
            raise ValueError(f"{name} {tuple(t.shape)} must be [{num_tokens}, 1, {half}]")
        require_last_dim_contiguous(name, t)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        require_last_dim_contiguous(name, t)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    _rope_store_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=k.shape[1],
        HALF=half,
        BLOCK_QH=next_power_of_2(num_heads),
        BLOCK_H=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
    )
    return q_out
