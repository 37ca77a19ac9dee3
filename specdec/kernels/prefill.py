"""Varlen prefill/extend attention over the paged KV cache (Triton), next to its reference.

Each sequence's ``q_len`` new queries attend causally over its paged context: the cached
prefix plus the new tokens, already written to the cache. Query ``i`` of sequence ``s`` sits
at absolute position ``seq_lens[s] - q_len + i`` and sees keys ``0 ..`` that position.

Work split: one program per (query tile, KV head, sequence). A tile's rows are
``tokens x group``: the ``group`` query heads sharing a KV head are packed into the rows
with ``tokens_per_tile = block_m // group`` tokens, so every K/V tile read serves the whole
group and a one-token sequence still fills ``group`` rows instead of one. Keys stream in
tiles of ``block_n`` with an online softmax (running max and sum in log2 units, fp32
accumulator). Key tiles wholly before the tile's first query position need no causal mask
and take the cheaper loop.

Split-K: when even the smallest tiles leave SMs idle (a verify step at small batch), each
tile's keys are also split ``num_splits`` ways across programs, which write unnormalised
partials (acc, running max, sum) that a combine kernel merges; otherwise one program per
tile loops over all keys and writes the output itself. The split length is computed in
the kernel from the tile's real key range (``cdiv(kv_hi, num_splits)`` rounded up to
``block_n``), so a CUDA graph captured at the longest context still spreads a short one
over all its splits. A split program runs iff its first key precedes its tile's last query
position + 1, and then writes every row of the tile (rows that see no key in it write an
empty partial); the combine recomputes the same split length and reads only those.

Draft trees (``meta.has_tree``, rule in ``specdec.ops.attention_metadata``) compile a variant
whose masked loop also reads the tree-mask bits of (tree query row, tree key column) pairs.
The unmasked loop then stops at the tree's first cache index as well as at the diagonal: a
tree row sees all keys before the tree but only its ancestors inside it. Tiles wholly before
the tree keep the causal bounds and their mask-bit loads are predicated off, so the extra
work is the handful of key tiles that overlap the tree.

Graph safety: the grid comes from ``meta.max_query_len`` (a host upper bound) and tensor
shapes; tiles past a sequence's real ``q_len`` exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import (
    RUNTIME_INTS,
    dot_precision,
    gqa_group,
    next_power_of_2,
    num_sms,
    require_grid_yz,
    require_kv_cache,
    require_last_dim_contiguous,
    require_launchable,
)
from specdec.kernels.split_k import merge_partial
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import paged_attention_ref

__all__ = [
    "PrefillConfig",
    "choose_num_splits",
    "default_prefill_config",
    "paged_attention",
    "paged_attention_ref",
    "prefill_block_m_choices",
    "prefill_config_for",
]

# Finite stand-in for -inf as the running max's start: padded rows see no key at all, and
# exp2(-inf - -inf) would be NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch knobs; ``block_m`` rows = tokens_per_tile x group."""

    block_m: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} {n} must be a power of two >= 16 (tl.dot)")


def prefill_block_m_choices(group: int, dtype: torch.dtype) -> list[int]:
    """Every ``block_m`` ``default_prefill_config`` may pick, smallest first: powers of two
    from the smallest that holds a GQA group (at least 16, for ``tl.dot``) up to 128 (64
    in fp32, whose FMA-unit dots spill registers at 128)."""
    cap = 64 if dtype == torch.float32 else 128
    block_m = max(16, next_power_of_2(group))
    choices = [block_m]
    while block_m < cap:
        block_m *= 2
        choices.append(block_m)
    return choices


def prefill_config_for(block_m: int) -> PrefillConfig:
    """The launch knobs that go with ``block_m`` (eight warps from 128 rows)."""
    return PrefillConfig(block_m=block_m, num_warps=8 if block_m >= 128 else 4)


def default_prefill_config(
    max_query_len: int,
    group: int,
    dtype: torch.dtype,
    *,
    num_seqs: int = 1,
    num_kv_heads: int = 1,
    num_sms: int = 1,
) -> PrefillConfig:
    """Rows sized to the work and to the GPU: the largest tile (``prefill_block_m_choices``;
    never more rows than a sequence has) whose grid still gives every SM a program, else
    the smallest — a 64-node verify step at batch 1 runs 16-row tiles (plus split-K) where
    128-row ones would leave 126 of 132 SMs idle. Powers of two keep the number of
    compiled variants small."""
    choices = prefill_block_m_choices(group, dtype)
    smallest = choices[0]
    block_m = min(choices[-1], max(smallest, next_power_of_2(max_query_len * group)))
    while block_m > smallest:
        tiles = triton.cdiv(max(max_query_len, 1), block_m // group)
        if tiles * num_kv_heads * num_seqs >= num_sms:
            break
        block_m //= 2
    return prefill_config_for(block_m)


# Split programs per SM a small launch aims at (the gate stays one program per SM). A
# verify step at batch 16 has 48 programs: one wave of long key loops at 1 per SM, where
# more, shorter splits hide each loop's load latency, as the decode kernel's four per SM
# do. H200, 4-token verify at batch 16 and 4,096 tokens of context: 2.06 ms at 1, 1.58 at
# 4, 1.72 at 8, against 1.42 for a decode step (docs/benchmarks.md, "Long context").
SPLIT_PROGRAMS_PER_SM = 4


def choose_num_splits(num_programs: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Split-K ways for a varlen launch of ``num_programs`` (tiles x KV heads x sequences)
    programs: none once every SM has a program, else enough for ``SPLIT_PROGRAMS_PER_SM``
    programs per SM, but not more than gives each split two key tiles at the host bound
    ``max_seq_len``."""
    if num_programs >= num_sms:
        return 1
    by_length = triton.cdiv(max(max_seq_len, 1), 2 * block_n)
    wanted = triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, num_programs)
    return max(1, min(wanted, by_length))


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table,
    kv_head_off,
    q_pos,
    key_lo,
    key_hi,
    scale_log2,
    stride_cb,
    stride_cs,
    offs_n,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    TREE: tl.constexpr,
    tree_mask_ptr,
    tree_lo,
    tree_len,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) over keys [key_lo, key_hi).

    With CAUSAL false every key in range is visible to every row (the caller guarantees
    key_hi <= the tile's first query position + 1, <= seq_len and, with a tree, <= the
    tree's first cache index ``tree_lo``). With TREE, a causally visible key at cache index
    >= tree_lo also needs bit [q_pos - tree_lo, pos - tree_lo] of the sequence's
    ``[tree_len, tree_len]`` mask at ``tree_mask_ptr`` (uint8).
    """
    for n0 in range(key_lo, key_hi, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] absolute key positions
        n_mask = pos < key_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head_off
        kv_off = row[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if TREE:
                ti = q_pos - tree_lo  # [BLOCK_M] tree node of each row (< 0: before the tree)
                tj = pos - tree_lo  # [BLOCK_N] tree node of each key
                # visible implies tj <= ti; ti < tree_len drops padded rows past the sequence.
                in_tree = visible & (tj[None, :] >= 0) & (ti[:, None] < tree_len)
                bit = tl.load(
                    tree_mask_ptr + ti[:, None] * tree_len + tj[None, :], mask=in_tree, other=1
                )
                visible = visible & (bit != 0)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tile_rows(
    tile,
    kvh,
    seq,
    query_start_loc_ptr,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The rows of one (query tile, KV head, sequence) program: ``tokens_per_tile`` tokens
    x ``group`` query heads. Returns (q_start, q_len, first_tok, tok [BLOCK_M] token index
    in the sequence, head [BLOCK_M] query head, row_mask [BLOCK_M], row_off [BLOCK_M]
    packed token index)."""
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = tile * TOKENS_PER_TILE
    offs_m = tl.arange(0, BLOCK_M)
    tok = first_tok + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    return q_start, q_len, first_tok, tok, head, row_mask, (q_start + tok).to(tl.int64)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tree_lens_ptr,
    tree_mask_offsets_ptr,
    tree_mask_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale_log2,
    num_splits,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kvh = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    _, q_len, first_tok, tok, head, row_mask, row_off = _tile_rows(
        tile, kvh, seq, query_start_loc_ptr, GROUP, TOKENS_PER_TILE, BLOCK_M
    )
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # absolute position of query 0

    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = ctx + tok  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    kv_head_off = kvh * stride_ch
    # Keys before the tile's first query position (and before the tree, if any) are
    # visible to all its rows.
    diag = ctx + first_tok
    tree_len = 0
    tree_lo = seq_len
    seq_mask_ptr = tree_mask_ptr
    if HAS_TREE:
        tree_len = tl.load(tree_lens_ptr + seq)
        tree_lo = seq_len - tree_len
        seq_mask_ptr = tree_mask_ptr + tl.load(tree_mask_offsets_ptr + seq)
        diag = tl.minimum(diag, tree_lo)
    full_hi = (diag // BLOCK_N) * BLOCK_N
    kv_hi = ctx + tl.minimum(q_len, first_tok + TOKENS_PER_TILE)  # last query position + 1
    lo = 0
    hi = kv_hi
    if not SINGLE_SPLIT:  # this program's keys: [lo, hi), split_len a multiple of BLOCK_N
        split_len = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        if lo >= kv_hi:
            return
        hi = tl.minimum(lo + split_len, kv_hi)
    m_i, l_i, acc = _attend_tile(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head_off, q_pos, lo,
        tl.minimum(hi, full_hi), scale_log2, stride_cb, stride_cs, offs_n, offs_d, d_mask,
        BLOCK_SIZE, BLOCK_N, False, False, seq_mask_ptr, tree_lo, tree_len, DOT_PRECISION,
    )  # fmt: skip
    m_i, l_i, acc = _attend_tile(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head_off, q_pos,
        tl.maximum(lo, full_hi), hi, scale_log2, stride_cb, stride_cs, offs_n, offs_d, d_mask,
        BLOCK_SIZE, BLOCK_N, True, HAS_TREE, seq_mask_ptr, tree_lo, tree_len, DOT_PRECISION,
    )  # fmt: skip

    if SINGLE_SPLIT:
        # Every real row sees key 0, so l_i > 0 there; padded rows are not stored.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        # Partials are [num_splits, num_tokens, num_heads, (HEAD_DIM | 2)], contiguous.
        part = (split * num_tokens + row_off) * NUM_HEADS + head  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _prefill_combine_kernel(
    query_start_loc_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
    num_tokens,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Merge the split programs' partials of one (query tile, KV head, sequence)."""
    kvh = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    _, q_len, first_tok, _, head, row_mask, row_off = _tile_rows(
        tl.program_id(0), kvh, seq, query_start_loc_ptr, GROUP, TOKENS_PER_TILE, BLOCK_M
    )
    if first_tok >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len
    kv_hi = ctx + tl.minimum(q_len, first_tok + TOKENS_PER_TILE)
    split_len = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N  # as the kernel's
    ran = tl.cdiv(kv_hi, split_len)  # the splits whose programs wrote this tile

    offs_d = tl.arange(0, BLOCK_D)
    io_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(0, ran):
        part = (split * num_tokens + row_off) * NUM_HEADS + head
        m_s = tl.load(part_ml_ptr + part * 2, mask=row_mask, other=_NEG_BIG)
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=row_mask, other=0.0)
        a_s = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask, other=0.0
        )
        m_i, l_i, acc = merge_partial(m_i, l_i, acc, m_s, l_s, a_s)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _tree_args(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's three tree pointers: the checked tree tensors (the mask viewed as uint8,
    which every Triton version loads), or ``seq_lens`` as an unread placeholder."""
    if not meta.has_tree:
        return meta.seq_lens, meta.seq_lens, meta.seq_lens
    assert meta.tree_lens is not None and meta.tree_mask_offsets is not None
    assert meta.tree_mask is not None
    for name, t, dtype in [
        ("tree_lens", meta.tree_lens, torch.int32),
        ("tree_mask_offsets", meta.tree_mask_offsets, torch.int64),
        ("tree_mask", meta.tree_mask, torch.bool),
    ]:
        if t.dtype != dtype or t.dim() != 1:
            raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; it must be 1-d {dtype}")
        require_last_dim_contiguous(name, t)
    if meta.tree_lens.shape[0] != meta.num_seqs:
        raise ValueError(
            f"tree_lens has {meta.tree_lens.shape[0]} entries for {meta.num_seqs} sequences"
        )
    # An all-empty mask (every tree_lens[s] == 0) may have no storage; no bit is read then,
    # so any real buffer stands in for it.
    mask = meta.tree_mask if meta.tree_mask.numel() else meta.seq_lens
    return meta.tree_lens, meta.tree_mask_offsets, mask.view(torch.uint8)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    config: PrefillConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Causal attention of each sequence's new tokens over its paged context, with the
    draft-tree mask on each sequence's tree part when ``meta.has_tree``.

    Same contract and result as ``paged_attention_ref``; any mix of q_len (decodes,
    extends, whole prompts, trees) in one batch. ``meta.max_query_len`` must bound every
    q_len. ``num_splits`` overrides the split-K heuristic (1 turns splitting off).
    """
    require_kv_cache(k_cache, v_cache)
    require_launchable(_prefill_kernel, q, k_cache, meta.query_start_loc, meta.block_tables)
    require_last_dim_contiguous("q", q)
    require_last_dim_contiguous("block_tables", meta.block_tables)
    require_last_dim_contiguous("query_start_loc", meta.query_start_loc)
    require_last_dim_contiguous("seq_lens", meta.seq_lens)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    group = gqa_group(num_heads, num_kv_heads)
    sms = num_sms(q.device)
    config = config or default_prefill_config(
        meta.max_query_len,
        group,
        k_cache.dtype,
        num_seqs=meta.num_seqs,
        num_kv_heads=num_kv_heads,
        num_sms=sms,
    )
    if config.block_m < group:
        raise ValueError(f"block_m {config.block_m} must be >= the GQA group {group}")
    require_grid_yz("num_seqs", meta.num_seqs)
    tree_lens, tree_offsets, tree_mask = _tree_args(meta)
    out = torch.empty_like(q)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    tokens_per_tile = config.block_m // group
    num_tiles = triton.cdiv(max(meta.max_query_len, 1), tokens_per_tile)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tiles * num_kv_heads * meta.num_seqs, meta.max_seq_len, config.block_n, sms
        )
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    single = num_splits == 1
    if single:
        part_acc = part_ml = out
    else:
        part_acc = torch.empty(  # [num_splits, num_tokens, num_heads, head_dim]
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(  # [num_splits, num_tokens, num_heads, 2]: (max, sum)
            (num_splits, num_tokens, num_heads, 2), dtype=torch.float32, device=q.device
        )
    grid = (num_tiles * num_splits, num_kv_heads, meta.num_seqs)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        tree_lens,
        tree_offsets,
        tree_mask,
        part_acc,
        part_ml,
        scale * _LOG2E,
        num_splits,
        num_tokens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group,
        NUM_HEADS=num_heads,
        TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        HAS_TREE=meta.has_tree,
        SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not single:
        _prefill_combine_kernel[(num_tiles, num_kv_heads, meta.num_seqs)](
            meta.query_start_loc,
            meta.seq_lens,
            part_acc,
            part_ml,
            out,
            num_splits,
            num_tokens,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            NUM_HEADS=num_heads,
            TOKENS_PER_TILE=tokens_per_tile,
            HEAD_DIM=head_dim,
            BLOCK_M=config.block_m,
            BLOCK_D=next_power_of_2(head_dim),
            BLOCK_N=config.block_n,
        )
    return out
