"""Attention of the block drafter in training: many blocks of packed sequences in one call.

Keys are laid out as ``[context keys of every packed position (n) ; block keys (A * B)]``,
queries are the block tokens (A blocks of B, block-major). ``block_visible`` states the rule
once: a block token sees the context positions of its own sequence strictly before its
block's anchor, and every token of its own block (bidirectional) — the same keys
``BlockDrafter.block_logits`` gives a block at inference, so training and drafting compute
one function. A padding block (sequence -1) sees only itself.

Two implementations with equal results (``block_attention`` picks one): ``reference``, one SDPA call
with a dense [A * B, n + A * B] mask (any device; memory grows with that product), and
``flex``, one FlexAttention call with a block mask from the same rule (compiled on CUDA,
where it skips the blocks no query sees).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models.block_drafter import ContextKV


@dataclass
class BlockMeta:
    """Where the context keys and the blocks of one packed batch lie."""

    ctx_seq: torch.Tensor  # [n] int64: sequence of each context position
    ctx_local: torch.Tensor  # [n] int64: its position within the sequence
    block_seq: torch.Tensor  # [A] int64: sequence of each block (-1: padding block)
    block_anchor: torch.Tensor  # [A] int64: local position of each block's anchor
    block_size: int


def block_visible(
    meta: BlockMeta,
    q_idx: torch.Tensor,  # query index (block token, block-major)
    kv_idx: torch.Tensor,  # key index into [context ; blocks]
) -> torch.Tensor:  # bool, the arguments broadcast together
    """Whether a block token sees a key (module docstring). Elementwise, so it serves the
    dense mask and FlexAttention's mask_mod alike."""
    n = meta.ctx_seq.shape[0]
    q_block = q_idx // meta.block_size
    is_ctx = kv_idx < n
    ctx = kv_idx.clamp(max=n - 1)
    ctx_ok = (
        is_ctx
        & (meta.ctx_seq[ctx] == meta.block_seq[q_block])
        & (meta.ctx_local[ctx] < meta.block_anchor[q_block])
    )
    own = ~is_ctx & ((kv_idx - n).clamp(min=0) // meta.block_size == q_block)
    return ctx_ok | own


# (q [m, heads, d], k, v [m, kv_heads, d]: the blocks'; context of the layer; meta) -> out
PackedBlockAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, ContextKV, BlockMeta, float], torch.Tensor
]


def reference_attention(q, k, v, context: ContextKV, meta: BlockMeta, scale: float):
    """One SDPA call over [context ; blocks] with the dense ``block_visible`` mask."""
    m, n = q.shape[0], context.k.shape[0]
    q_idx = torch.arange(m, device=q.device)[:, None]
    kv_idx = torch.arange(n + m, device=q.device)[None, :]
    mask = block_visible(meta, q_idx, kv_idx)  # [m, n + m]
    keys = torch.cat([context.k, k]).transpose(0, 1)  # [kv_heads, n + m, d]
    values = torch.cat([context.v, v]).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [heads, m, d]
    return out.transpose(0, 1)


def flex_attention(compile: bool) -> PackedBlockAttention:
    """FlexAttention with a block mask from ``block_visible``; ``compile`` runs its fused
    kernel (eager FlexAttention is a slow reference). Static shapes avoid recompiles: the
    trainer pads batches to one size and samples a fixed number of anchors."""

    def attend(q, k, v, context: ContextKV, meta: BlockMeta, scale: float):
        m, n = q.shape[0], context.k.shape[0]

        def mask_mod(b, h, q_idx, kv_idx):
            return block_visible(meta, q_idx, kv_idx)

        block_mask = _block_mask(compile)(mask_mod, None, None, m, n + m, device=q.device)
        keys = torch.cat([context.k, k]).transpose(0, 1).unsqueeze(0)  # [1, kv, n + m, d]
        values = torch.cat([context.v, v]).transpose(0, 1).unsqueeze(0)
        out = _flex(compile)(q.transpose(0, 1).unsqueeze(0), keys, values,
                             block_mask=block_mask, scale=scale, enable_gqa=True)  # fmt: skip
        return out[0].transpose(0, 1)  # [m, heads, d]

    return attend


@functools.cache
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False) if compiled else flex


@functools.cache
def _block_mask(compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False) if compiled else create_block_mask


def block_attention(name: str, device: torch.device) -> tuple[PackedBlockAttention, bool]:
    """(the implementation, whether it wants static shapes) for ``ttt.attention``'s names:
    ``auto`` is compiled flex on CUDA and the reference elsewhere (as for EAGLE-3)."""
    if name == "flex" or (name == "auto" and device.type == "cuda"):
        compiled = device.type == "cuda"
        return flex_attention(compiled), compiled
    return reference_attention, False
