"""Batch-invariant paged attention (Triton), next to its PyTorch reference.

The invariant: a token's attention output is bitwise the same whether it is computed as a
prefill token (whole prompt or any chunking), a one-token decode, a row of a verified
chain, or an accepted draft-tree node at any node index, and whatever other sequences and
queries share the launch. The varlen and decode kernels do not have it: their split-K
count, query tiles and key tiles follow the batch, and a tree node's ancestors sit at
``root + node_index`` while verifying but at ``root + depth`` in plain decoding, so their
key tiles group different keys.

How the kernels keep it:

* Keys are reduced in *logical position* order (``ops.attention_metadata``, "Logical
  positions"): blocks of ``block_n`` logical positions from 0, and a tree query maps its
  logical positions past the tree's first cache index through ``tree_paths`` to its
  ancestors' slots, so an accepted node at depth ``d`` reads exactly the keys, in exactly
  the blocks, of the token at ``root + d`` in plain decoding.
* The split over keys is fixed by position, never by the grid: key block ``b`` belongs to
  split ``b % num_splits``. Each split's partial state is an fp32 online softmax over
  its blocks in increasing order, from the empty state; the combine kernel merges a
  token's ``num_splits`` partial states, always all of them and always in one vectorised
  reduction of fixed shape. Which program computes a split is free, since it changes
  none of the split's arithmetic: the split kernel runs ``P`` programs per (query tile,
  KV head), program ``p`` computing splits ``p, p + P, ...`` one after another, with
  ``P`` sized to the launch (every split its own program at batch 1, where a long
  context then spreads over ``num_splits`` programs; fewer, longer programs when the
  query tiles alone fill the GPU). The grid holds a slot per tile the launch may have
  (``tile_bound``) and ``split_programs`` programs per slot; the kernel deals the slots
  to the real tiles in turn and sizes ``P`` by the same rule on their real count, so
  tiles of several tree rows take the slots they leave free as more programs. The
  grouping of keys is the same for every token at every batch.
* A program's tile holds the GQA groups of up to ``TILE_TOKENS`` consecutive query rows
  before a tree (``ops.query_tiles``; they share every K/V tile), or of consecutive tree
  rows (one, or up to ``TREE_TILE_TOKENS`` where the launch shares tree tiles:
  ``query_tiles.shared_tree_from``), in ``max(16, next_power_of_2(TILE_TOKENS * group))``
  rows. Tree rows of one tile share the K/V tiles of the blocks before the tree's first
  block; each block from there on is read once per tree row, through that
  row's path, with the other rows' scores masked to -inf (which leaves their states
  exactly as they were, as below), so every row sees its own keys in its own blocks. Every
  ``tl.dot`` has that one shape, and a tensor-core product computes each output element
  from its own row and column alone, so which rows share a tile changes no row's bits.
  Each row keeps its own key count: a block holding none of a row's keys gives the row
  scores of -inf, which leave its max, sum and accumulator exactly as they were (a row
  that has seen no key keeps the empty state, the exponent taken against 0 rather than
  -inf), so a row runs exactly the arithmetic of its blocks, alone or not.
* A split with none of a row's keys leaves it the empty state (max -inf, sum 0,
  accumulator 0), which the merge weighs by exactly 0. Positions past every row's keys
  load zeros for K and V. A row's first block in a split holds its first key there, so
  its max is finite from then on: the rescale ``exp2(m_old - m_new)`` is exactly 0 there
  and exactly 1.0 whenever a block leaves the max unchanged. Split 0 holds position 0, so
  the merged max is finite.
* The batch reaches the kernels only through runtime integers that change no arithmetic,
  kept unspecialised, and trees through a runtime flag: one compiled variant serves every
  batch of a model and dtype (``block_n``, ``num_splits``, ``TILE_TOKENS``,
  ``TREE_TILE_TOKENS``, head dim and group are its only constants; which tree rows share
  a tile and how many programs a tile gets are runtime values).

Graph safety: the grids are (query rows, KV heads, split programs), a bound on the tiles,
and (query rows, heads), from tensor shapes, the config and the device; the query tiles
and tree tables are built with device ops, once per forward by the backend's ``prepare``
or here when ``meta`` lacks them (``ops.query_tiles``, ``ops.tree_paths``). Nothing syncs
with the host.
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
    num_sms,
    require_kv_cache,
    require_last_dim_contiguous,
    require_launchable,
)
from specdec.ops import query_tiles
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import gather_context
from specdec.ops.query_tiles import TILE_TOKENS, tree_tile_tokens, with_query_tiles
from specdec.ops.tree_paths import with_tree_paths

__all__ = [
    "MIN_SPLIT_PROGRAMS",
    "PROGRAMS_PER_SM",
    "InvariantAttentionConfig",
    "invariant_attention_ref",
    "invariant_paged_attention",
    "logical_key_indices",
    "split_programs",
    "tile_bound",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class InvariantAttentionConfig:
    """Launch constants. ``block_n`` and ``num_splits`` fix the reduction's grouping of
    keys and ``num_warps`` may order a block's sums, so they are part of the result:
    outputs are invariant only between launches with the same config."""

    # Measured on an H100 against other block sizes and split counts (decodes at batch 1
    # to 64 over 300 and 1,500 keys): 32 x 16 was fastest at batch 1 and within 20% of
    # the best elsewhere.
    block_n: int = 32  # logical positions per online-softmax block
    num_splits: int = 16  # key block b goes to split b % num_splits
    # The split kernel's warps: they lay a tile's rows and keys out over threads, which
    # may order a row's sums differently, so every launch shares them. One warp measured
    # 2-12% faster than four at every shape on an H100 but the lone decode row (6.6
    # against 5.4 µs over 300 keys), two and eight slower (docs/benchmarks.md).
    num_warps: int = 1
    # Programs per query tile and KV head, each computing splits p, p + P, ... in turn (P
    # a power of two dividing num_splits); None: ``split_programs`` picks P from the
    # launch's rows. Which program computes a split changes none of its arithmetic, so P is
    # free per launch: all splits at batch 1, fewer programs doing more each at batch 64.
    split_programs: int | None = None
    # Software-pipelining stages of the split kernel's block loops (None: Triton's
    # default). They order loads, not sums, so like ``split_programs`` they change no bit.
    num_stages: int | None = None

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n {self.block_n} must be a power of two >= 16 (tl.dot)")
        if self.num_splits < 1 or self.num_splits & (self.num_splits - 1):
            raise ValueError(
                f"num_splits {self.num_splits} must be a power of two >= 1 (the combine "
                "kernel reduces the splits as one tile)"
            )
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages {self.num_stages} must be >= 1, or None for Triton's")
        p = self.split_programs
        if p is not None and (p < 1 or p & (p - 1) or p > self.num_splits):
            raise ValueError(
                f"split_programs {p} must be a power of two from 1 to num_splits "
                f"({self.num_splits}), or None to size it to the launch"
            )


PROGRAMS_PER_SM = 8
"""``split_programs`` keeps a launch within this many split-kernel programs per SM: one
program per split while that fits (a batch-1 decode, where a long context then spreads
over all 16 splits' programs), fewer and longer programs as the query tiles grow (on an
H100: a batch-1 tree of 32 or 16 chains get 8 programs per tile and KV head, batch-64
decodes 4). A program's fixed work (its tile's metadata and queries) is then paid once for
several splits, and fewer programs run empty splits. Measured on an H100 in the engine
(deterministic humaneval): 8 against 16 and 4 was the fastest at batch 1 (tree) and 64."""

MIN_SPLIT_PROGRAMS = 4
"""The fewest programs per (query tile, KV head) however full the launch: one or two
programs walk a long prompt's blocks nearly one after another (a 1,024-row prefill chunk:
125 µs with one program per tile and KV head, 108 with four, on an H100)."""


def tile_bound(num_tokens: int, num_seqs: int, has_tree: bool) -> int:
    """A host bound on a launch's query tiles (``ops.query_tiles``, built on the device):
    every row where trees may hold one row a tile, else ``TILE_TOKENS`` rows a tile plus
    one partial tile per sequence."""
    if has_tree:
        return num_tokens
    return min(num_tokens, -(-num_tokens // TILE_TOKENS) + num_seqs)


def split_programs(
    num_tiles: int, num_kv_heads: int, config: InvariantAttentionConfig, sms: int
) -> int:
    """Programs per (query tile, KV head) of a launch of at most ``num_tiles`` query tiles
    (``tile_bound``): the config's, else the largest power of two up to ``num_splits``
    that keeps ``num_tiles * num_kv_heads * P`` within ``PROGRAMS_PER_SM * sms``, and at
    least ``MIN_SPLIT_PROGRAMS`` (or ``num_splits`` where that is fewer). A function of
    host ints alone: a CUDA graph of a batch size keeps its choice."""
    if config.split_programs is not None:
        return config.split_programs
    room = PROGRAMS_PER_SM * sms // max(1, num_tiles * num_kv_heads)
    p = min(MIN_SPLIT_PROGRAMS, config.num_splits)
    while p * 2 <= min(room, config.num_splits):
        p *= 2
    return p


# Every integer argument: none may compile a variant of its own (specialisation on == 1 or
# divisibility by 16 would let two batches run different code).
_RUNTIME_INTS = (
    "num_seqs",
    "has_tree",
    "shared_from",
    "program_room",
    "max_programs",
    "stride_qt",
    "stride_qh",
    "stride_cb",
    "stride_cs",
    "stride_ch",
    "stride_bt",
    "stride_ps",
    "stride_pn",
    "stride_ds",
)


@triton.jit
def _attend_block(
    q,  # [ROWS, BLOCK_D], the caches' dtype
    k_cache_ptr,
    v_cache_ptr,
    row,  # [BLOCK_N] int64: each key's offset in the caches (its page, slot and KV head)
    loaded,  # [BLOCK_N]: the key is some row's (loaded; zeros elsewhere)
    valid,  # [ROWS, BLOCK_N]: the key is this row's
    offs_d,
    d_mask,
    m_i,  # [ROWS] running max, log2 units; -inf while a row has seen no key
    l_i,  # [ROWS] running sum
    acc,  # [ROWS, BLOCK_D] running weighted sum of V
    scale_log2,
    DOT_PRECISION: tl.constexpr,
):
    """One block of the online softmax; the same arithmetic wherever the keys come from
    and whichever rows share the tile. A block with none of a row's keys leaves the row's
    state exactly as it was: its scores are -inf, so its max, sum and accumulator gain
    exact zeros (a row with no key yet keeps the empty state: ``m_safe`` keeps
    ``-inf - -inf`` out of the exponent)."""
    kv_off = row[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    kv_mask = loaded[:, None] & d_mask[None, :]
    # Zeros past every row's keys, whatever the slots hold (NaN times a zero weight is NaN).
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_N]
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # 0 on a row's first block, 1.0 when the max holds
    p = tl.exp2(s - m_safe[:, None])  # exact zeros off the row's keys
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _invariant_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, BLOCK_D] fp32, unnormalised
    tile_starts_ptr,
    tile_seqs_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tree_lens_ptr,
    tree_paths_ptr,
    tree_depths_ptr,
    scale_log2,
    num_seqs,
    has_tree,
    shared_from,  # trees from this cache index share tiles (ops.query_tiles.shared_tree_from)
    program_room,  # programs the GPU holds per KV head (PROGRAMS_PER_SM x SMs / KV heads)
    max_programs,  # the most programs per (tile, KV head): the config's, else NUM_SPLITS
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ps,
    stride_pn,
    stride_ds,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    TREE_TILE: tl.constexpr,  # tree rows per shared tile (query_tiles.TREE_TILE_TOKENS)
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_PROGRAMS: tl.constexpr,  # min(MIN_SPLIT_PROGRAMS, NUM_SPLITS)
    DOUBLINGS: tl.constexpr,  # log2(NUM_SPLITS)
    DOT_PRECISION: tl.constexpr,
):
    # The grid is a host bound: a slot per query row, P programs per slot. The launch's
    # real tiles take the slots in turn, so a tile gets P programs per slot it holds, as
    # many as ``split_programs`` grants the real tile count (a long tree's tiles of
    # several rows leave slots to spare); the programs past that return at once.
    n_tiles = tl.maximum(tl.load(tile_starts_ptr + num_seqs), 1)
    tile = tl.program_id(0) % n_tiles
    lap = tl.program_id(0) // n_tiles
    kvh = tl.program_id(1)
    limit = tl.minimum(program_room // n_tiles, max_programs)  # max_programs <= NUM_SPLITS
    programs = tl.full([], MIN_PROGRAMS, tl.int32)
    for _ in tl.static_range(DOUBLINGS):  # split_programs' rule on the real tile count
        programs = tl.where(programs * 2 <= limit, programs * 2, programs)
    programs = tl.minimum(programs, tl.num_programs(2) * (tl.num_programs(0) // n_tiles))
    first_split = tl.program_id(2) + lap * tl.num_programs(2)
    if first_split >= programs:
        return
    seq = tl.load(tile_seqs_ptr + tile).to(tl.int64)
    if seq >= num_seqs:  # past the last tile
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # cache index of the sequence's first query row
    tree_len = tl.load(tree_lens_ptr + seq, mask=has_tree != 0, other=0)
    tree_lo = seq_len - tree_len  # tree nodes sit at cache indices tree_lo ..
    n_plain = tl.maximum(q_len - tree_len, 0)  # query rows before the tree
    plain_tiles = tl.cdiv(n_plain, TILE_TOKENS)
    tree_tile = tl.where(tree_lo >= shared_from, TREE_TILE, 1)  # ops.query_tiles' rule
    local = tile - tl.load(tile_starts_ptr + seq)
    is_tree = local >= plain_tiles  # a tile of tree rows
    first = tl.where(is_tree, n_plain + (local - plain_tiles) * tree_tile, local * TILE_TOKENS)
    count = tl.minimum(
        tl.where(is_tree, q_len, n_plain) - first, tl.where(is_tree, tree_tile, TILE_TOKENS)
    )

    # Rows: token-major, each token's GQA group of query heads; padded rows have no keys.
    offs_m = tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    in_tile = offs_m // GROUP  # [ROWS] the row's token within the tile
    row_ok = in_tile < count
    token = (q_start + first + in_tile).to(tl.int64)  # [ROWS] query row in the batch
    head = kvh * GROUP + offs_m % GROUP  # [ROWS]
    q_pos = first_pos + first + in_tile  # [ROWS] cache index of each row's query
    # A tree row's logical keys: those before tree_lo, then its path (depth + 1 nodes).
    node0 = tl.maximum(first_pos + first - tree_lo, 0)  # the tile's first tree node
    node = node0 + in_tile  # [ROWS]
    tree_row = row_ok & (q_pos >= tree_lo)  # [ROWS]
    depth = tl.load(tree_depths_ptr + seq * stride_ds + node, mask=tree_row, other=0)
    n_keys = tl.where(row_ok, tl.where(is_tree, tree_lo + depth + 1, q_pos + 1), 0)  # [ROWS]
    max_keys = tl.max(n_keys, 0)
    paths = tree_paths_ptr + seq * stride_ps + node0 * stride_pn

    io_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [ROWS, BLOCK_D]; padded rows are zeros and never stored
    q = q.to(k_cache_ptr.dtype.element_ty)

    table = block_tables_ptr + seq * stride_bt
    kv_head = kvh * stride_ch
    n_blocks = tl.cdiv(max_keys, BLOCK_N)
    first_path_block = tl.where(is_tree, tree_lo // BLOCK_N, n_blocks)
    # The splits this program computes, one after another: each from its own empty state
    # over its own blocks, exactly as a program of its own would.
    for split in range(first_split, NUM_SPLITS, programs):
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        # This split's blocks: split, split + NUM_SPLITS, ... (fixed by position), in two
        # loops that differ only in where a block's keys live: blocks wholly before the
        # tree (every block of a plain tile) read cache index = logical position for every
        # row at once, a table lookup the compiler can prefetch; the rest go through each
        # tree row's path, row by row. Both run a row's arithmetic on the row's keys, so
        # where one loop hands over to the other changes no bit.
        for b in range(split, first_path_block, NUM_SPLITS):
            lpos = b * BLOCK_N + offs_n  # [BLOCK_N] logical positions = cache indices
            loaded = lpos < max_keys
            page = tl.load(table + lpos // BLOCK_SIZE, mask=loaded, other=0).to(tl.int64)
            row = page * stride_cb + (lpos % BLOCK_SIZE) * stride_cs + kv_head
            m_i, l_i, acc = _attend_block(
                q,
                k_cache_ptr,
                v_cache_ptr,
                row,
                loaded,
                lpos[None, :] < n_keys[:, None],
                offs_d,
                d_mask,
                m_i,
                l_i,
                acc,
                scale_log2,
                DOT_PRECISION,
            )
        # This split's first block at or past first_path_block.
        behind = tl.maximum(first_path_block - split, 0)
        path_start = split + tl.cdiv(behind, NUM_SPLITS) * NUM_SPLITS
        for b in range(path_start, n_blocks, NUM_SPLITS):
            lpos = b * BLOCK_N + offs_n  # [BLOCK_N] logical positions
            for r in tl.static_range(TREE_TILE):  # tree row r of the tile, then the next
                if r < count:  # a row past the tile's would leave every state as it is
                    mine = in_tile == r  # [ROWS] its GQA group's rows
                    r_keys = tl.max(tl.where(mine, n_keys, 0), 0)
                    loaded = lpos < r_keys
                    in_tree = loaded & (lpos >= tree_lo)
                    anc = tl.load(paths + r * stride_pn + (lpos - tree_lo), mask=in_tree, other=0)
                    cidx = tl.where(in_tree, tree_lo + anc, lpos)  # [BLOCK_N] cache indices
                    page = tl.load(table + cidx // BLOCK_SIZE, mask=loaded, other=0).to(tl.int64)
                    row = page * stride_cb + (cidx % BLOCK_SIZE) * stride_cs + kv_head
                    m_i, l_i, acc = _attend_block(
                        q,
                        k_cache_ptr,
                        v_cache_ptr,
                        row,
                        loaded,
                        mine[:, None] & (lpos[None, :] < n_keys[:, None]),
                        offs_d,
                        d_mask,
                        m_i,
                        l_i,
                        acc,
                        scale_log2,
                        DOT_PRECISION,
                    )

        # The partial states, empty (-inf, 0, 0) where a row has no key in this split.
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split  # [ROWS]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None]
        )


@triton.jit(do_not_specialize=["num_seqs", "stride_ot", "stride_oh"])
def _invariant_combine_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    query_start_loc_ptr,
    num_seqs,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # a padded row: no partials
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
    m = tl.load(part_m_ptr + part)
    l_s = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :])  # [S, BLOCK_D]
    m_max = tl.max(m, 0)  # exact, any order; finite (split 0 holds position 0)
    w = tl.exp2(m - m_max)  # exactly 0 for an empty split
    l_sum = tl.sum(l_s * w, 0)
    o = tl.sum(acc * w[:, None], 0) / l_sum  # [BLOCK_D]
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
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
    require_launchable(_invariant_split_kernel, q, k_cache, meta.query_start_loc, meta.block_tables)
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
    meta = with_query_tiles(meta)
    assert meta.tile_starts is not None and meta.tile_seqs is not None
    if meta.tile_seqs.shape[0] != num_tokens:
        raise ValueError(
            f"meta.tile_seqs has {meta.tile_seqs.shape[0]} entries for {num_tokens} query "
            "rows; build the tiles from this batch's metadata "
            "(specdec.ops.query_tiles.with_query_tiles)"
        )
    splits, block_d = config.num_splits, next_power_of_2(head_dim)
    part_m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(
        num_tokens, num_heads, splits, block_d, dtype=torch.float32, device=q.device
    )
    # The grid: a slot per tile the launch may have, ``programs`` per slot; the kernel
    # deals the slots to its real tiles and sizes their programs the same way.
    tiles = tile_bound(num_tokens, meta.num_seqs, meta.has_tree)
    sms = num_sms(q.device)
    programs = split_programs(tiles, num_kv_heads, config, sms)
    room = PROGRAMS_PER_SM * sms // num_kv_heads if config.split_programs is None else 1 << 30
    _invariant_split_kernel[(num_tokens, num_kv_heads, programs)](
        q,
        k_cache,
        v_cache,
        part_m,
        part_l,
        part_acc,
        meta.tile_starts,
        meta.tile_seqs,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        tree_lens,
        paths,
        depths,
        scale * _LOG2E,
        meta.num_seqs,
        int(meta.has_tree),
        query_tiles.shared_tree_from(num_tokens),
        room,
        config.split_programs or splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        paths.stride(0),
        paths.stride(1) if paths.dim() > 1 else 0,
        depths.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        TILE_TOKENS=TILE_TOKENS,
        TREE_TILE=tree_tile_tokens(),
        ROWS=max(16, next_power_of_2(TILE_TOKENS * group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        NUM_SPLITS=splits,
        MIN_PROGRAMS=min(MIN_SPLIT_PROGRAMS, splits),
        DOUBLINGS=splits.bit_length() - 1,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=config.num_warps,
        **({} if config.num_stages is None else {"num_stages": config.num_stages}),
    )
    _invariant_combine_kernel[(num_tokens, num_heads)](
        out,
        part_m,
        part_l,
        part_acc,
        meta.query_start_loc,
        meta.num_seqs,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        num_warps=1,
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
