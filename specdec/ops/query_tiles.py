"""Query tiles of the batch-invariant attention kernel: ``AttentionMetadata.tile_starts``
and ``tile_seqs`` (``ops.attention_metadata``, "Query tiles").

A tile is the rows one program of ``kernels/invariant_attention.py`` attends for: up to
``TILE_TOKENS`` consecutive query rows of one sequence that all lie before its tree (their
logical positions are cache indices, so one K/V tile serves them all), or consecutive tree
rows (they share the K/V tiles before the tree; past its start each reads its own
ancestors): one a tile where the tree starts before ``LONG_TREE_KEYS``, up to
``TREE_TILE_TOKENS`` from there (``tree_tile_rows``). A prefill chunk of ``n`` rows is
``cdiv(n, TILE_TOKENS)`` tiles, a decode one tile, a ``t``-node tree ``t`` or ``cdiv(t,
TREE_TILE_TOKENS)``. How rows share a tile never changes a row's bits (the kernel's
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
    "LONG_TREE_KEYS",
    "TILE_TOKENS",
    "TREE_TILE_TOKENS",
    "query_tiles",
    "tree_tile_rows",
    "tree_tile_tokens",
    "with_query_tiles",
]

TILE_TOKENS = 4  # query rows per tile before a tree: 4 x a GQA group of <= 4 fills 16 rows

TREE_TILE_TOKENS = 4
"""Tree rows per tile of a tree that starts at or past ``LONG_TREE_KEYS``, 1 to
``TILE_TOKENS``. Rows sharing a tile read the blocks before the tree once, but past the
tree's start the kernel walks each row's path in turn."""

LONG_TREE_KEYS = 1024
"""Where a tree's rows start sharing tiles: a tree whose first node sits at this cache
index or later has ``TREE_TILE_TOKENS`` rows a tile, an earlier one a row a tile. Over a
short context a tile's work is its path blocks, which a shared tile walks once per row;
over a long one it is the blocks before the tree, which a shared tile reads once for all
its rows. On an H100 (bf16, SmolLM2's heads, a batch-1 32-node tree) one row a tile took
10.9 µs over 300 keys against 14.9 shared by four, and 26.1 / 44.1 / 66.7 µs over 1,500 /
3,000 / 5,000 keys against 22.1 / 30.5 / 40.4 (docs/benchmarks.md, "Invariant attention").
Both module constants are read at each call, so the kernel's launch and the tiles agree."""


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
    per_tree_tile = tree_tile_rows(meta.seq_lens - tree_lens)  # [num_seqs]
    tiles = (plain + TILE_TOKENS - 1) // TILE_TOKENS + (
        tree_rows + per_tree_tile - 1
    ) // per_tree_tile
    starts = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=loc.device)
    starts[1:] = torch.cumsum(tiles, 0)
    rows = torch.arange(meta.slot_mapping.shape[0], dtype=torch.int32, device=loc.device)
    return starts, torch.searchsorted(starts[1:], rows, right=True)


def tree_tile_rows(tree_starts: torch.Tensor) -> torch.Tensor:
    """Tree rows per tile of trees whose first nodes sit at cache indices ``tree_starts``
    (any shape): ``TREE_TILE_TOKENS`` from ``LONG_TREE_KEYS`` on, else 1. The kernel
    applies the same rule to each sequence."""
    return torch.where(tree_starts >= LONG_TREE_KEYS, tree_tile_tokens(), 1)


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
