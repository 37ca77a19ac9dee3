"""The PyTorch reference of attention over the paged KV cache and of the cache's writes and
moves: the readable statement of ``attention_metadata.py``'s rule, the ground truth the
Triton kernels (``specdec.kernels``) are tested against, and what the torch backend
(``specdec.attention.torch_backend``) runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.rope import apply_rotary


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


def move_kvcache_ref(
    caches: Sequence[torch.Tensor],  # each [num_blocks, block_size, kv_heads, head_dim]
    src: torch.Tensor,  # [...] int64 slots
    dst: torch.Tensor,  # [...] int64 slots, src's shape
) -> None:
    """Copy slot ``src[i]`` to ``dst[i]`` in every cache; all sources are read before any
    destination is written (so a move may land on a slot another move reads)."""
    src, dst = src.flatten(), dst.flatten()
    for cache in caches:
        flat = cache.view(-1, *cache.shape[2:])  # [num_slots, kv_heads, head_dim]
        flat.index_copy_(0, dst, flat.index_select(0, src))


def rope_store_kvcache_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: q after RoPE
    """Rotate q and k, store the rotated k and v in the cache; returns the rotated q."""
    store_kvcache_ref(apply_rotary(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return apply_rotary(q, cos, sin)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


def gather_contexts(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    num_blocks: int,
) -> torch.Tensor:  # [num_seqs, num_blocks * block_size, num_kv_heads, head_dim]
    """Every sequence's first ``num_blocks`` blocks, padded contexts side by side (one
    ``index_select``: on CPU several times faster than advanced indexing). Entries past a
    sequence's length are zeroed: unwritten cache slots may hold anything, NaN included,
    and a NaN value times a zero attention weight would still poison the output."""
    table = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.index_select(0, table)  # [num_seqs * num_blocks, block_size, kvh, d]
    ctx = blocks.view(block_tables.shape[0], -1, *cache.shape[2:])
    if ctx.device.type == "cpu" and not torch.compiler.is_compiling():
        # Each padded tail is one contiguous memset; a broadcast masked_fill over the
        # whole gather costs several times the gather itself on CPU (reading the lengths
        # there is free, where a GPU would have to sync).
        for row, length in zip(ctx, seq_lens.tolist(), strict=True):
            row[length:].zero_()
        return ctx
    valid = torch.arange(ctx.shape[1], device=ctx.device)[None, :] < seq_lens[:, None]
    return ctx.masked_fill_(~valid[:, :, None, None], 0)


def attention_mask_ref(
    q_len: int,
    seq_len: int,
    tree: torch.Tensor | None,  # [tree_len, tree_len] bool, or None: no tree
    device: torch.device,
) -> torch.Tensor:  # [q_len, seq_len] bool
    """Which keys each new token of one sequence sees (the rule in ``attention_metadata.py``).

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


def is_gqa(num_heads: int, num_kv_heads: int) -> bool:
    """SDPA's ``enable_gqa`` as a Python bool. Under torch.compile the head dims read off
    tensor shapes can be symbolic (``dynamic=True``, or dims dynamo made dynamic after a
    recompile) and SDPA rejects a SymBool. ``not`` makes dynamo decide the comparison
    with a guard, where ``bool(a != b)`` would still trace to a SymBool."""
    return not num_heads == num_kv_heads  # noqa: SIM201


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
            enable_gqa=is_gqa(num_heads, num_kv_heads),
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
    # [B, nb*bs, kvh, d]
    keys = gather_contexts(k_cache, meta.block_tables, meta.seq_lens, max_blocks)
    vals = gather_contexts(v_cache, meta.block_tables, meta.seq_lens, max_blocks)
    pos = torch.arange(keys.shape[1], device=q.device)
    mask = (pos[None, :] < meta.seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :].to(keys.dtype),  # [B, H, 1, d]
        keys.transpose(1, 2),  # [B, kvh, L, d]
        vals.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=is_gqa(num_heads, num_kv_heads),
    )
    return o[:, :, 0, :].to(q.dtype)
