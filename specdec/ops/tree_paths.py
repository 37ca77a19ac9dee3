"""Logical positions of draft-tree queries: ``AttentionMetadata.tree_paths``/``tree_depths``.

Row ``i`` of a tree's ancestor mask marks node ``i`` and its ancestors. Parents precede
their children, so those nodes in increasing node index are the path from the (forest) root
down to ``i``, one per depth: ``tree_paths[s, i, k]`` is the node at depth ``k`` on node
``i``'s path and ``tree_depths[s, i]`` is ``i``'s depth (the row's count of set bits, less
one). The batch-invariant attention kernel reads logical position ``r + k`` of a tree query
from cache index ``r + tree_paths[s, i, k]`` (``ops.attention_metadata``, "Logical
positions").

Built from the tree fields alone with device ops (a gather, a stable sort, a sum): nothing
reads device values back, and the shapes come from ``num_seqs`` and the host bound
``max_tree_len``, so the tables can be built inside a captured CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.ops.attention_metadata import AttentionMetadata

__all__ = ["padded_tree_masks", "tree_paths", "with_tree_paths"]


def padded_tree_masks(meta: AttentionMetadata) -> torch.Tensor:  # [num_seqs, tm, tm] bool
    """Every sequence's ``[t, t]`` ancestor mask padded to ``tm = max_tree_len``; rows and
    columns past a sequence's ``t`` are false."""
    if not meta.has_tree:
        raise ValueError("the batch has no tree fields (max_tree_len is 0); nothing to pad")
    assert meta.tree_lens is not None and meta.tree_mask_offsets is not None
    assert meta.tree_mask is not None
    device = meta.seq_lens.device
    tm = meta.max_tree_len
    t = meta.tree_lens.long()[:, None, None]  # [num_seqs, 1, 1]
    r = torch.arange(tm, device=device)
    inside = (r[None, :, None] < t) & (r[None, None, :] < t)  # [num_seqs, tm, tm]
    if meta.tree_mask.numel() == 0:  # every tree empty: nothing to gather from
        return inside
    flat = meta.tree_mask_offsets[:, None, None] + r[None, :, None] * t + r
    return meta.tree_mask[torch.where(inside, flat, 0)] & inside


def tree_paths(
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_seqs, tm, tm] int32, [num_seqs, tm] int32
    """``(tree_paths, tree_depths)`` of ``meta``'s trees (module docstring)."""
    masks = padded_tree_masks(meta)
    # A stable sort of "not visible" puts the visible nodes first, in node order: the path.
    paths = torch.sort((~masks).to(torch.uint8), dim=2, stable=True).indices
    depths = masks.sum(2, dtype=torch.int32) - 1  # -1 on rows past the tree (never read)
    return paths.to(torch.int32), depths


def with_tree_paths(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with ``tree_paths``/``tree_depths`` attached (``meta`` itself when they are
    already there or it has no trees). Build once per forward: every layer reuses them."""
    if not meta.has_tree or meta.has_tree_paths:
        return meta
    paths, depths = tree_paths(meta)
    return dataclasses.replace(meta, tree_paths=paths, tree_depths=depths)
