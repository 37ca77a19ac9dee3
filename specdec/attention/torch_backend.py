"""Reference attention backend in plain PyTorch (any device).

It is the ground truth the Triton kernels are tested against, and the CPU path. Three
paths compute the same rule (``ops.attention_metadata``): decode-only batches and tree
batches of short queries (verify and draft steps: ``BATCHED_MAX_QUERY``) run as one padded,
masked attention over every sequence's gathered context; the rest loops over sequences
(``ops.paged_attention.paged_attention_ref``, the readable statement of the rule). Prefills
stay on the loop because there a sequence's result must not depend on the batch around it
bit for bit (the dump's states equal a single-sequence forward): a padded attention reduces
over a longer, batch-dependent key axis, which changes fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionBackend
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import (
    gather_contexts,
    is_gqa,
    paged_attention_ref,
    paged_decode_ref,
    store_kvcache_ref,
)

# Tree batches whose queries are all this short run padded in one call (a per-sequence loop
# costs a masked attention call per sequence and layer, most of a CPU verify step's time).
BATCHED_MAX_QUERY = 64
# ... unless the padded [num_seqs, max_query_len, max_seq_len] mask would exceed this.
BATCHED_MAX_MASK = 1 << 23


def paged_attention_batched_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``paged_attention_ref``'s rule as one padded attention: queries padded to
    ``max_query_len`` and contexts to the longest sequence, the causal and tree rules
    applied as one [num_seqs, max_query_len, max_seq_len] mask. Padded query rows see key 0
    only (no empty softmax) and are dropped."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    device = q.device
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()  # [B]
    seq_lens = meta.seq_lens.long()  # [B]
    num_seqs, qm = q_lens.shape[0], meta.max_query_len
    max_blocks = (meta.max_seq_len + block_size - 1) // block_size
    # [B, L, kvh, d]
    keys = gather_contexts(k_cache, meta.block_tables, meta.seq_lens, max_blocks)
    vals = gather_contexts(v_cache, meta.block_tables, meta.seq_lens, max_blocks)
    length = keys.shape[1]
    i = torch.arange(qm, device=device)
    real = i[None, :] < q_lens[:, None]  # [B, qm]: real query rows
    q_pos = seq_lens[:, None] - q_lens[:, None] + i[None, :]  # [B, qm] cache index
    k = torch.arange(length, device=device)
    mask = (k[None, None, :] <= q_pos[:, :, None]) & (k[None, None, :] < seq_lens[:, None, None])
    if meta.has_tree:
        assert meta.tree_lens is not None and meta.tree_mask_offsets is not None
        assert meta.tree_mask is not None
        t = meta.tree_lens.long()  # [B]
        tm = meta.max_tree_len
        r = torch.arange(tm, device=device)
        inside = (r[None, :, None] < t[:, None, None]) & (r[None, None, :] < t[:, None, None])
        flat = meta.tree_mask_offsets[:, None, None] + r[None, :, None] * t[:, None, None] + r
        trees = meta.tree_mask[torch.where(inside, flat, 0)] & inside  # [B, tm, tm]
        first = (seq_lens - t)[:, None]  # [B, 1]: the tree's first cache index
        qi = (q_pos - first).clamp(0, tm - 1)  # [B, qm]: query's tree node (tm >= 1)
        ki = (k[None, :] - first).clamp(0, tm - 1)  # [B, L]: key's tree node
        bit = trees[torch.arange(num_seqs, device=device)[:, None, None], qi[:, :, None],
                    ki[:, None, :]]  # fmt: skip
        mask &= (k[None, None, :] < first[:, :, None]) | bit
    mask[:, :, 0] |= ~real  # padded rows: key 0, so no softmax is empty
    q_pad = q.new_zeros(num_seqs, qm, num_heads, q.shape[2])
    q_pad[real] = q  # tokens are sequence-major, as the padded rows are
    o = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2).to(keys.dtype),  # [B, H, qm, d]
        keys.transpose(1, 2),  # [B, kvh, L, d]
        vals.transpose(1, 2),
        attn_mask=mask[:, None],  # [B, 1, qm, L]
        scale=scale,
        enable_gqa=is_gqa(num_heads, num_kv_heads),
    )
    return o.transpose(1, 2)[real].to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:  # never true for tree batches (see AttentionMetadata)
            return paged_decode_ref(q, k_cache, v_cache, meta, scale)
        num_seqs = meta.seq_lens.shape[0]
        if (
            meta.has_tree
            and meta.max_query_len <= BATCHED_MAX_QUERY
            and num_seqs * meta.max_query_len * meta.max_seq_len <= BATCHED_MAX_MASK
        ):
            return paged_attention_batched_ref(q, k_cache, v_cache, meta, scale)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
