"""The block drafter's attention in PyTorch: the reference ``kernels.block_attention``
equals (every block token sees its request's context positions ``0 .. r - 1``, read from
paged K/V by slot, and all ``B`` keys of its own block)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """``block_attention`` in PyTorch, one block at a time: the context rows gathered by
    slot, then SDPA over [context; block] with nothing masked."""
    out = torch.empty_like(q)
    for b, r in enumerate(context_lens.tolist()):
        pos = torch.arange(r, device=q.device)
        slots = block_tables[b, pos // page_size].long() * page_size + pos % page_size
        rows = slice(b * block_size, (b + 1) * block_size)
        keys = torch.cat([k_cache[slots], k[rows]])  # [r + B, kv_heads, head_dim]
        values = torch.cat([v_cache[slots], v[rows]])
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).float(),
            keys.transpose(0, 1).float(),
            values.transpose(0, 1).float(),
            scale=scale,
            enable_gqa=True,
        )  # [heads, B, head_dim]
        out[rows] = o.transpose(0, 1).to(q.dtype)
    return out
