"""Query tiles of the batch-invariant attention kernel: ``AttentionMetadata.tile_starts``
and ``tile_seqs`` (``ops.attention_metadata``, "Query tiles").

A tile is the rows one program of ``kernels/invariant_attention.py`` attends for: up to
``TILE_TOKENS`` consecutive query rows of one sequence that all lie before its tree (their
logical positions are cache indices, so one K/V tile serves them all), or consecutive tree
rows (they share the K/V tiles before the tree; past its start each reads its own
ancestors): one a tile, or up to ``TREE_TILE_TOKENS`` where the launch shares tree tiles
(``shared_tree_from``: by its row count and the tree's start). A prefill chunk of ``n``
rows is ``cdiv(n, TILE_TOKENS)`` tiles, a decode one tile, a ``t``-node tree ``t`` or
``cdiv(t, TREE_TILE_TOKENS)``. How rows share a tile never changes a row's bits (the kernel's
docstring says why), only how often its keys are read.

Built from ``query_start_loc``, ``seq_lens`` and ``tree_lens`` with device ops (a clamp,
a cumulative sum, a search): nothing reads device values back, and the shapes come from
``num_seqs`` and the row count, so the tables can be built inside a captured CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.ops.attention_metadata import AttentionMetadata

__all__ = [
    "FEW_ROWS",
    "LONG_TREE_KEYS",
    "MANY_ROWS",
    "NEVER",
    "TILE_TOKENS",
    "TREE_TILE_TOKENS",
    "query_tiles",
    "shared_tree_from",
    "tree_tile_rows",
    "tree_tile_tokens",
    "with_query_tiles",
]

TILE_TOKENS = 4  # query rows per tile before a tree: 4 x a GQA group of <= 4 fills 16 rows

TREE_TILE_TOKENS = 4
"""Tree rows per tile where trees share tiles (``shared_tree_from``), 1 to
``TILE_TOKENS``. Rows sharing a tile read the blocks before the tree once, but past the
tree's start the kernel walks each row's path in turn."""

FEW_ROWS = 24
"""Launches of at most this many query rows give every tree row a tile of its own."""
MANY_ROWS = 96
"""Launches of at least this many query rows share tiles between the rows of every tree."""
LONG_TREE_KEYS = 1024
"""Between ``FEW_ROWS`` and ``MANY_ROWS``, the cache index from which a tree's rows share
tiles.

A tile's programs walk their splits' blocks one after another, so a tile's time follows
the blocks each of its programs walks. A row a tile reads the context once per tree row
but spreads the rows over more programs; while the launch's rows leave room for every
split to have its own program (a chain at batch 1) that is fastest at any context, and
once they fill the GPU (16 chains, 4 trees of 32) fewer, shared tiles get more programs
each. Between the two the context decides: over a short one a tile's work is its path
blocks, which a shared tile walks once per row, over a long one the blocks before the
tree. Measured on an H100 (bf16, SmolLM2's heads, µs, one row a tile against four):
a batch-1 32-node tree 11.0 / 14.4 over 300 keys, 20.4 / 20.9 over 1,100, 24.5 / 20.7
over 1,500, 53.9 / 36.3 over 4,000; a batch-1 6-node chain 12.5 / 19.8 over 1,500; 16
chains of 6 22.9 / 19.2 over 300, 76.6 / 33.0 over 1,500 (docs/benchmarks.md, "Invariant
attention"). The module's constants are read at each call, so the kernel's launch and the
tiles agree."""

NEVER = 2**31 - 1  # a cache index no tree reaches (the kernel compares it as int32)


def shared_tree_from(num_rows: int) -> int:
    """The cache index from which trees share tiles in a launch of ``num_rows`` query rows
    (padding included): ``NEVER`` up to ``FEW_ROWS``, 0 from ``MANY_ROWS``, else
    ``LONG_TREE_KEYS``. A function of the launch's shape alone, so a CUDA graph keeps it."""
    if num_rows <= FEW_ROWS:
        return NEVER
    if num_rows >= MANY_ROWS:
        return 0
    return LONG_TREE_KEYS


def query_tiles(
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_seqs + 1] int32, [num_tokens] int64
    """``(tile_starts, tile_seqs)`` of ``meta``'s batch (module docstring)."""
    loc = meta.query_start_loc
    q_lens = loc[1:] - loc[:-1]  # [num_seqs]
    tree_lens = meta.tree_lens if meta.has_tree else torch.zeros_like(meta.seq_lens)
    assert tree_lens is not None
    # Rows before the tree: from cache index seq_len - q_len up to seq_len - tree_len.
    plain = torch.clamp(q_lens - tree_lens, min=0)
    tree_rows = q_lens - plain
    shared_from = shared_tree_from(meta.slot_mapping.shape[0])
    per_tree_tile = tree_tile_rows(meta.seq_lens - tree_lens, shared_from)  # [num_seqs]
    tiles = (plain + TILE_TOKENS - 1) // TILE_TOKENS + (
        tree_rows + per_tree_tile - 1
    ) // per_tree_tile
    starts = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=loc.device)
    starts[1:] = torch.cumsum(tiles, 0)
    rows = torch.arange(meta.slot_mapping.shape[0], dtype=torch.int32, device=loc.device)
    return starts, torch.searchsorted(starts[1:], rows, right=True)


def tree_tile_rows(tree_starts: torch.Tensor, shared_from: int) -> torch.Tensor:
    """Tree rows per tile of trees whose first nodes sit at cache indices ``tree_starts``
    (any shape): ``TREE_TILE_TOKENS`` from ``shared_from`` on (``shared_tree_from``), else
    1. The kernel applies the same rule to each sequence."""
    return torch.where(tree_starts >= shared_from, tree_tile_tokens(), 1)


def tree_tile_tokens() -> int:
    """``TREE_TILE_TOKENS``, checked."""
    if not 1 <= TREE_TILE_TOKENS <= TILE_TOKENS:
        raise ValueError(
            f"TREE_TILE_TOKENS={TREE_TILE_TOKENS} must be between 1 and TILE_TOKENS={TILE_TOKENS}"
        )
    return TREE_TILE_TOKENS


def with_query_tiles(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with its query tiles attached (``meta`` itself when already there). Build
    once per forward: every layer reuses them."""
    if meta.tile_starts is not None:
        return meta
    starts, seqs = query_tiles(meta)
    return dataclasses.replace(meta, tile_starts=starts, tile_seqs=seqs)
