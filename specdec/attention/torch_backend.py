"""Reference attention backend in plain PyTorch (any device).

It is the ground truth the Triton kernels are tested against, and the CPU path. Three
paths compute the same rule (``metadata.py``): decode-only batches and tree batches of
short queries (verify and draft steps: ``BATCHED_MAX_QUERY``) run as one padded, masked
attention over every sequence's gathered context; the rest loops over sequences
(``paged_attention_ref``, the readable statement of the rule). Prefills stay on the loop
because there a sequence's result must not depend on the batch around it bit for bit (the
dump's states equal a single-sequence forward): a padded attention reduces over a longer,
batch-dependent key axis, which changes fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    from specdec.models.rope import apply_rotary  # specdec.models imports this package

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
    valid = torch.arange(ctx.shape[1], device=ctx.device)[None, :] < seq_lens[:, None]
    return ctx.masked_fill_(~valid[:, :, None, None], 0)


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
