"""Batch-invariant Triton attention backend: ``specdec.kernels.invariant_attention``.

Same contract as the ``triton`` backend (cache write, RoPE fused into it, the causal and
tree rules of ``ops.attention_metadata``), but one kernel for every batch whose output for a
token does not depend on the token's kind (prefill, chunk, decode, chain or tree row) nor on
the batch around it: the attention half of a deterministic mode in which speculative output
equals plain output token for token. The cache write and RoPE work per token, so they are
invariant already and are the ``triton`` backend's.

Trees need ``meta.tree_paths`` and every launch the query tiles (``meta.tile_starts``,
``tile_seqs``): ``prepare`` attaches both once per forward (``ops.tree_paths``,
``ops.query_tiles``; device ops, graph-safe); a layer called without them builds them
itself.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from specdec.attention.triton_backend import TritonAttentionBackend
from specdec.kernels.invariant_attention import (
    InvariantAttentionConfig,
    invariant_paged_attention,
)
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.query_tiles import with_query_tiles
from specdec.ops.tree_paths import with_tree_paths


class InvariantTritonBackend(TritonAttentionBackend):
    name = "triton_invariant"
    # One config for every launch: outputs are invariant only between launches sharing it.
    config: ClassVar[InvariantAttentionConfig] = InvariantAttentionConfig()

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return with_query_tiles(with_tree_paths(meta))

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return invariant_paged_attention(q, k_cache, v_cache, meta, scale, config=self.config)
