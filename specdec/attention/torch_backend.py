"""Reference attention backend in plain PyTorch (any device).

It is the ground truth the Triton kernels are tested against, and the CPU path. It loops
over sequences on the host, so it favours clarity over speed; decode-only batches take a
batched gather path because CPU decoding is dominated by them. Batches with draft trees
always take the per-sequence path, which applies the tree mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionBackend
from specdec.attention.metadata import AttentionMetadata


def store_kvcache_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K/V into its cache slot (slot = block * block_size + offset)."""
    _, _, kvh, d = k_cache.shape
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


def attention_mask_ref(
    q_len: int,
    seq_len: int,
    tree: torch.Tensor | None,  # [tree_len, tree_len] bool, or None: no tree
    device: torch.device,
) -> torch.Tensor:  # [q_len, seq_len] bool
    """Which keys each new token of one sequence sees (the rule in ``metadata.py``).

    Query i sits at cache index seq_len - q_len + i and sees keys 0..that (causal). When the
    last tree_len new tokens form a tree, keys inside the tree additionally need the tree
    mask bit; everything before the tree stays visible to the tree's queries.
    """
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    mask = torch.arange(seq_len, device=device)[None, :] <= q_pos  # [q_len, L]
    if tree is not None and tree.shape[0] > 0:
        t = tree.shape[0]
        if t > seq_len:
            raise ValueError(f"tree_len {t} exceeds the sequence's seq_len {seq_len}")
        # The queries are the tree's last min(q_len, t) nodes (a draft step adds a level to
        # a tree whose earlier levels are cached); queries before the tree stay causal.
        n = min(q_len, t)
        mask[q_len - n :, seq_len - t :] &= tree[t - n :].to(device=device, dtype=torch.bool)
    return mask


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's new tokens over its paged context: causal, with the
    draft-tree mask on the tree part when ``meta`` carries trees."""
    q_lens = meta.query_lens_cpu
    if q_lens is None:
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    tree_lens, tree_offsets = [0] * len(seq_lens), [0] * len(seq_lens)
    if meta.has_tree:
        assert meta.tree_lens is not None and meta.tree_mask_offsets is not None
        tree_lens, tree_offsets = meta.tree_lens.tolist(), meta.tree_mask_offsets.tolist()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        keys = gather_context(k_cache, meta.block_tables[s], seq_len)  # [L, kvh, d]
        vals = gather_context(v_cache, meta.block_tables[s], seq_len)
        q_s = q[start : start + q_len].transpose(0, 1)  # [H, q_len, d]
        t, off = tree_lens[s], tree_offsets[s]
        tree = None
        if t > 0:
            assert meta.tree_mask is not None
            tree = meta.tree_mask[off : off + t * t].view(t, t)
        mask = attention_mask_ref(q_len, seq_len, tree, q.device)  # [q_len, L]
        o = F.scaled_dot_product_attention(
            q_s.to(keys.dtype),
            keys.transpose(0, 1),
            vals.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
        start += q_len
    return out


def paged_decode_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode (one query per sequence) as one batched, masked attention."""
    _num_seqs, num_heads, _d = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = (meta.max_seq_len + block_size - 1) // block_size
    table = meta.block_tables[:, :max_blocks].long()  # [B, nb]
    keys = k_cache[table].flatten(1, 2)  # [B, nb*bs, kvh, d]
    vals = v_cache[table].flatten(1, 2)
    pos = torch.arange(keys.shape[1], device=q.device)
    mask = (pos[None, :] < meta.seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :].to(keys.dtype),  # [B, H, 1, d]
        keys.transpose(1, 2),  # [B, kvh, L, d]
        vals.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return o[:, :, 0, :].to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:  # never true for tree batches (see AttentionMetadata)
            return paged_decode_ref(q, k_cache, v_cache, meta, scale)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
