"""Write new tokens' K/V into the paged cache (Triton), next to its PyTorch reference.

Token ``t`` goes to slot ``slot_mapping[t]`` (slot = block * block_size + offset, see
``specdec.attention.metadata``). Padded tokens carry slots inside the null block 0, so the
kernel needs no sentinel test and launches a fixed grid of one program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.attention.torch_backend import store_kvcache_ref
from specdec.kernels.launch import (
    next_power_of_2,
    require_kv_cache,
    require_last_dim_contiguous,
    require_launchable,
)

__all__ = ["store_kvcache", "store_kvcache_ref"]


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
