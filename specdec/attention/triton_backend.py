"""Triton attention backend: the paged FlashAttention-style kernels of ``specdec.kernels``.

Same contract and results as the ``torch`` reference backend. Every launch is sync-free
and sized from tensor shapes and the host bounds in ``AttentionMetadata``, so a forward
through this backend can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from specdec.attention.base import AttentionBackend
from specdec.kernels import paged_attention, paged_decode, rope_store_kvcache, store_kvcache
from specdec.ops.attention_metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    fuses_rope = True

    def forward_rope(self, q, k, v, cos, sin, k_cache, v_cache, meta, scale):
        """RoPE inside the cache write (one kernel for rotation and store)."""
        q = rope_store_kvcache(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _attend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # Decode-only batches take the split-K kernel: one query per sequence leaves the
        # varlen kernel's query tiles mostly empty and a long context on few programs.
        # Tree batches are never decode-only: the varlen kernel applies the tree mask.
        if meta.is_decode_only:
            return paged_decode(q, k_cache, v_cache, meta, scale)
        return paged_attention(q, k_cache, v_cache, meta, scale)
