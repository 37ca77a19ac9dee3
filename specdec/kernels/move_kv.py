"""Move K/V entries between cache slots in every layer at once (Triton), next to the
PyTorch reference.

After tree verification the accepted path's K/V moves next to the root, in every layer:
with one tensor per layer and per K/V that is 2 ops per cache, 120 kernels a step for a
30-layer target, where a step on the GPU is launch-bound (~2 µs a kernel). This kernel does
the whole move in one launch: the caches are reached through a table of their base
addresses (``cache_pointer_table``), one program per (cache, row of moves).

Semantics, per row of moves: every source of the row is read before any destination of it
is written (a block-wide barrier between the two), so a path node may shift onto a slot
another move of the same row reads. Different rows must not share slots, except inside the
null block 0, which padding rows may all write.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import next_power_of_2, require_launchable
from specdec.ops.paged_attention import move_kvcache_ref as move_kv_slots_ref

__all__ = ["cache_pointer_table", "move_kv_slots", "move_kv_slots_ref"]


def cache_pointer_table(caches: Sequence[torch.Tensor]) -> torch.Tensor:  # [num_caches] int64
    """The base addresses of ``caches`` (every layer's K and V cache, all of one shape and
    dtype, contiguous), on their device: what ``move_kv_slots`` reads them through. Valid
    as long as the caches live (they are allocated once per engine)."""
    first = caches[0]
    for c in caches:
        if c.shape != first.shape or c.dtype != first.dtype or not c.is_contiguous():
            raise ValueError(
                f"every cache must be contiguous with {tuple(first.shape)} {first.dtype}; got "
                f"{tuple(c.shape)} {c.dtype}"
            )
    ptrs = [c.data_ptr() for c in caches]
    return torch.tensor(ptrs, dtype=torch.int64).to(first.device)


@triton.jit
def _move_kv_kernel(
    table_ptr,
    src_ptr,
    dst_ptr,
    n,
    stride_slot,
    SLOT_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SLOT: tl.constexpr,
    DTYPE: tl.constexpr,
):
    cache = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    base = tl.load(table_ptr + cache).to(tl.pointer_type(DTYPE))
    offs_n = tl.arange(0, BLOCK_N)
    offs = tl.arange(0, BLOCK_SLOT)
    n_ok = offs_n < n
    # int64: a multi-GB cache has more elements than int32 can address.
    src = tl.load(src_ptr + row * n + offs_n, mask=n_ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + row * n + offs_n, mask=n_ok, other=0).to(tl.int64)
    mask = n_ok[:, None] & (offs[None, :] < SLOT_SIZE)
    x = tl.load(base + src[:, None] * stride_slot + offs[None, :], mask=mask)
    tl.debug_barrier()  # every source of the row read before a destination is written
    tl.store(base + dst[:, None] * stride_slot + offs[None, :], x, mask=mask)


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def move_kv_slots(
    table: torch.Tensor,  # [num_caches] int64: ``cache_pointer_table(caches)``
    like: torch.Tensor,  # one of the caches: shape and dtype of all
    src: torch.Tensor,  # [rows, n] int64 slots
    dst: torch.Tensor,  # [rows, n] int64 slots
) -> None:
    """``move_kv_slots_ref`` over the caches of ``table`` in one launch."""
    require_launchable(_move_kv_kernel, like, src, dst, table)
    if src.shape != dst.shape or src.dim() != 2:
        raise ValueError(
            f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be one [rows, n] shape"
        )
    if like.dtype not in _TRITON_DTYPES:
        raise ValueError(f"cache dtype {like.dtype} is not one of {list(_TRITON_DTYPES)}")
    rows, n = src.shape
    if rows == 0 or n == 0:
        return
    slot_size = like.shape[2] * like.shape[3]
    _move_kv_kernel[(table.shape[0], rows)](
        table,
        src.contiguous(),
        dst.contiguous(),
        n,
        like.stride(1),
        SLOT_SIZE=slot_size,
        BLOCK_N=next_power_of_2(n),
        BLOCK_SLOT=next_power_of_2(slot_size),
        DTYPE=_TRITON_DTYPES[like.dtype],
    )
