"""Batch-invariant paged attention (Triton), next to its PyTorch reference.

The invariant: a token's attention output is bitwise the same whether it is computed as a
prefill token (whole prompt or any chunking), a one-token decode, a row of a verified
chain, or an accepted draft-tree node at any node index, and whatever other sequences and
queries share the launch. The varlen and decode kernels do not have it: their split-K
count, query tiles and key tiles follow the batch, and a tree node's ancestors sit at
``root + node_index`` while verifying but at ``root + depth`` in plain decoding, so their
key tiles group different keys.

How the kernel keeps it:

* Keys are reduced in *logical position* order (``ops.attention_metadata``, "Logical
  positions"): blocks of ``block_n`` logical positions from 0, an fp32 online softmax over
  the blocks in increasing order, no split-K. A tree query maps its logical positions
  past the tree's first cache index through ``tree_paths`` to its ancestors' slots, so an
  accepted node at depth ``d`` reads exactly the keys, in exactly the blocks, of the token
  at ``root + d`` in plain decoding.
* One program per (token, KV head). Its tile rows are that token's GQA group of query heads
  padded to ``max(16, next_power_of_2(group))``; no other token shares it, so every
  ``tl.dot`` has one shape and the same operands whatever the batch.
* A program runs exactly ``cdiv(n, block_n)`` blocks for a query with ``n`` logical keys.
  Positions ``>= n`` in the last block load zeros for K and V and get score -inf: they add
  exact zeros to the sum and the output and cannot raise the running max. Position 0 is
  in every query's first block, so the max is finite from the first block on and the
  rescale factor ``exp2(m_old - m_new)`` is exactly 0 there (``m_old`` = -inf) and exactly
  1.0 whenever a block leaves the max unchanged.
* The batch reaches the kernel only through runtime integers that change no arithmetic,
  kept unspecialised, and trees through a runtime flag: one compiled variant serves every
  batch of a model and dtype (``block_n``, head dim and group are its only constants).

Graph safety: the grid is (tokens, KV heads), from tensor shapes; token -> sequence is a
device ``searchsorted``; the tree tables are built with device ops when ``meta`` lacks them
(``ops.tree_paths``). Nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.kernels.launch import (
    dot_precision,
    gqa_group,
    next_power_of_2,
    require_kv_cache,
    require_last_dim_contiguous,
    require_launchable,
)
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import gather_context
from specdec.ops.tree_paths import with_tree_paths

__all__ = [
    "InvariantAttentionConfig",
    "invariant_attention_ref",
    "invariant_paged_attention",
    "logical_key_indices",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class InvariantAttentionConfig:
    """Launch constants. ``block_n`` fixes the reduction's grouping of keys, so it is part of
    the result: outputs are invariant only between launches with the same config."""

    block_n: int = 32  # logical positions per online-softmax block
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n {self.block_n} must be a power of two >= 16 (tl.dot)")


# Every integer argument: none may compile a variant of its own (specialisation on == 1 or
# divisibility by 16 would let two batches run different code).
_RUNTIME_INTS = (
    "num_seqs",
    "has_tree",
    "stride_qt",
    "stride_qh",
    "stride_ot",
    "stride_oh",
    "stride_cb",
    "stride_cs",
    "stride_ch",
    "stride_bt",
    "stride_ps",
    "stride_pn",
    "stride_ds",
)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _invariant_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    token_seq_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tree_lens_ptr,
    tree_paths_ptr,
    tree_depths_ptr,
    scale_log2,
    num_seqs,
    has_tree,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ps,
    stride_pn,
    stride_ds,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    if seq >= num_seqs:  # a row past query_start_loc[-1]: no sequence owns it
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - q_len + (token - q_start)  # the query's cache index

    # Logical keys 0 .. n_keys - 1; those from tree_lo on come through the tree path.
    tree_len = tl.load(tree_lens_ptr + seq, mask=has_tree != 0, other=0)
    tree_lo = seq_len - tree_len
    node = q_pos - tree_lo  # >= 0: the query is tree node `node`
    is_tree = node >= 0
    node = tl.maximum(node, 0)
    depth = tl.load(tree_depths_ptr + seq * stride_ds + node, mask=is_tree, other=0)
    n_keys = tl.where(is_tree, tree_lo + depth + 1, q_pos + 1)
    path = tree_paths_ptr + seq * stride_ps + node * stride_pn

    offs_m = tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + offs_m
    io_mask = (offs_m < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [ROWS, BLOCK_D]; padded rows are zeros and never stored
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(0, n_keys, BLOCK_N):
        lpos = n0 + offs_n  # [BLOCK_N] logical positions
        valid = lpos < n_keys
        in_tree = valid & (lpos >= tree_lo)  # only tree queries reach past tree_lo
        anc = tl.load(path + (lpos - tree_lo), mask=in_tree, other=0)
        cidx = tl.where(in_tree, tree_lo + anc, lpos)  # [BLOCK_N] cache indices
        block = tl.load(table + cidx // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (cidx % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_off = row[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = valid[:, None] & d_mask[None, :]
        # Zeros past n_keys, whatever the slots hold (a NaN times a zero weight is NaN).
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: position 0 is in the first block
        alpha = tl.exp2(m_i - m_new)  # 0 on the first block, 1.0 when the max holds
        p = tl.exp2(s - m_new[:, None])  # exact zeros past n_keys
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _tree_tensors(
    meta: AttentionMetadata,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``meta`` with its tree tables, and the kernel's (tree_lens, tree_paths, tree_depths):
    checked tables, or ``seq_lens`` as unread placeholders when there is no tree."""
    if not meta.has_tree:
        return meta, meta.seq_lens, meta.seq_lens, meta.seq_lens
    meta = with_tree_paths(meta)
    assert meta.tree_lens is not None
    assert meta.tree_paths is not None and meta.tree_depths is not None
    b, tm = meta.num_seqs, meta.max_tree_len
    for name, t, shape in [
        ("tree_lens", meta.tree_lens, (b,)),
        ("tree_paths", meta.tree_paths, (b, tm, tm)),
        ("tree_depths", meta.tree_depths, (b, tm)),
    ]:
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} is {t.dtype} {tuple(t.shape)}; it must be int32 {shape} "
                "(num_seqs, max_tree_len): build it with specdec.ops.tree_paths"
            )
        require_last_dim_contiguous(name, t)
    return meta, meta.tree_lens, meta.tree_paths, meta.tree_depths


def invariant_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    config: InvariantAttentionConfig | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Attention of every new token over its paged context by the rule of
    ``ops.attention_metadata`` (causal, draft trees), batch-invariant (module docstring).
    Same result as ``paged_attention_ref`` up to rounding; any mix of prefill chunks,
    decodes and trees in one launch."""
    config = config or InvariantAttentionConfig()
    require_kv_cache(k_cache, v_cache)
    require_launchable(
        _invariant_attention_kernel, q, k_cache, meta.query_start_loc, meta.block_tables
    )
    for name, t in [
        ("q", q),
        ("block_tables", meta.block_tables),
        ("query_start_loc", meta.query_start_loc),
        ("seq_lens", meta.seq_lens),
    ]:
        require_last_dim_contiguous(name, t)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    group = gqa_group(num_heads, num_kv_heads)
    meta, tree_lens, paths, depths = _tree_tensors(meta)
    out = torch.empty_like(q)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    # [num_tokens] the sequence of each token (num_seqs for rows past the last query).
    tokens = torch.arange(num_tokens, dtype=meta.query_start_loc.dtype, device=q.device)
    token_seq = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True)
    _invariant_attention_kernel[(num_tokens, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        token_seq,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        tree_lens,
        paths,
        depths,
        scale * _LOG2E,
        meta.num_seqs,
        int(meta.has_tree),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        paths.stride(0),
        paths.stride(1) if paths.dim() > 1 else 0,
        depths.stride(0),
        GROUP=group,
        ROWS=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=config.num_warps,
    )
    return out


# --- reference ---------------------------------------------------------------------------


def logical_key_indices(meta: AttentionMetadata) -> list[list[int]]:
    """Per query token (batch order), the cache index of each of its logical positions
    (``ops.attention_metadata``, "Logical positions"); reads the metadata to the host."""
    meta = with_tree_paths(meta)
    loc = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    tree_lens = meta.tree_lens.tolist() if meta.has_tree else [0] * len(seq_lens)
    out: list[list[int]] = []
    for s, seq_len in enumerate(seq_lens):
        q_len, t = loc[s + 1] - loc[s], tree_lens[s]
        for p in range(seq_len - q_len, seq_len):
            node = p - (seq_len - t)
            if node < 0:
                out.append(list(range(p + 1)))
                continue
            assert meta.tree_paths is not None and meta.tree_depths is not None
            depth = int(meta.tree_depths[s, node])
            path = meta.tree_paths[s, node, : depth + 1].tolist()
            out.append(list(range(seq_len - t)) + [seq_len - t + j for j in path])
    return out


def invariant_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The kernel's rule in plain PyTorch: each query attends to the keys its logical
    positions name (``logical_key_indices``), in the caches' dtype. The same key set as
    ``paged_attention_ref``'s mask, gathered through the tree paths."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = gqa_group(num_heads, num_kv_heads)
    loc = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    keys_of = logical_key_indices(meta)
    out = torch.empty_like(q)
    token = 0
    for s, seq_len in enumerate(seq_lens):
        keys = gather_context(k_cache, meta.block_tables[s], seq_len)  # [L, kvh, d]
        vals = gather_context(v_cache, meta.block_tables[s], seq_len)
        for _ in range(loc[s + 1] - loc[s]):
            idx = torch.tensor(keys_of[token], device=q.device)
            k = keys[idx].transpose(0, 1).repeat_interleave(group, 0)  # [H, n, d]
            v = vals[idx].transpose(0, 1).repeat_interleave(group, 0)
            w = F.softmax((q[token, :, None, :].to(k.dtype) @ k.transpose(1, 2)) * scale, -1)
            out[token] = (w @ v)[:, 0].to(q.dtype)  # [H, d]
            token += 1
    return out
