"""Draft-tree attention fields of ``AttentionMetadata`` from per-sequence parent arrays.

A draft tree of ``t`` nodes is given by ``parents`` (``[t]`` int): ``parents[0] == 0`` (the
root is its own parent) and ``parents[i] < i`` otherwise, so node order is a topological
order and node ``i``'s ancestors all precede it. Its mask row ``i`` marks node ``i`` and
every ancestor (the rule in ``specdec.ops.attention_metadata``).

The closure is computed on the parents' device with tensor ops only: pointer jumping
doubles the covered path length each round, so ``ceil(log2(t))`` rounds of one gather
each reach the root from any node. Nothing reads device values back to the host; node
counts come from tensor shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.ops.attention_metadata import AttentionMetadata

__all__ = ["TreeMask", "ancestor_closure", "build_tree_mask", "check_parents"]


@dataclass(frozen=True)
class TreeMask:
    """The four tree fields of ``AttentionMetadata`` for one batch."""

    tree_lens: torch.Tensor  # [num_seqs] int32
    tree_mask_offsets: torch.Tensor  # [num_seqs] int64: where seq s's mask starts
    tree_mask: torch.Tensor  # [sum_s tree_lens[s]**2] bool, row-major [t, t] per sequence
    max_tree_len: int  # host bound on tree_lens

    def attach(self, meta: AttentionMetadata) -> AttentionMetadata:
        """``meta`` with these tree fields (one entry per sequence of ``meta``); any
        ``tree_paths`` it carried described other trees and are dropped."""
        if self.tree_lens.shape[0] != meta.num_seqs:
            raise ValueError(
                f"tree fields cover {self.tree_lens.shape[0]} sequences but the batch has "
                f"{meta.num_seqs}; pass one parent array per sequence (empty for no tree)"
            )
        return dataclasses.replace(
            meta,
            tree_lens=self.tree_lens,
            tree_mask_offsets=self.tree_mask_offsets,
            tree_mask=self.tree_mask,
            max_tree_len=self.max_tree_len,
            tree_paths=None,
            tree_depths=None,
        )


def uniform_tree_mask(
    mask: torch.Tensor,  # [num_seqs, t, t] bool: every sequence's tree's ancestor mask
) -> TreeMask:
    """The tree fields of a batch whose sequences all end in a ``t``-node tree (a verify
    step of one shape, a draft level), from their stacked ancestor masks; device ops only
    (capturable)."""
    num_seqs, t, _ = mask.shape
    device = mask.device
    return TreeMask(
        tree_lens=torch.full((num_seqs,), t, dtype=torch.int32, device=device),
        tree_mask_offsets=torch.arange(num_seqs, device=device) * (t * t),
        tree_mask=mask.flatten(),
        max_tree_len=t,
    )


def ancestor_closure(
    parents: torch.Tensor,  # [num_trees, max_nodes] int: parent of each node, padded
    max_depth: int | None = None,
) -> torch.Tensor:  # [num_trees, max_nodes, max_nodes] bool
    """``out[b, i, j]``: node ``j`` is node ``i`` or an ancestor of ``i`` in tree ``b``.

    Padding nodes must carry a parent index inside ``[0, max_nodes)`` (0 is safe); real
    nodes never point at them, so their rows cannot leak into real rows. ``max_depth``
    bounds every node's depth (a shape's; default ``max_nodes - 1``): the closure takes
    ``ceil(log2(max_depth))`` rounds.
    """
    num_trees, n = parents.shape
    node = torch.arange(n, device=parents.device)
    jump = parents.long()  # [B, n]: the ancestor 2**k steps up (the root maps to itself)
    anc = (node[:, None] == node[None, :]) | (jump[:, :, None] == node)  # [B, n, n]
    # After round k, anc holds ancestors 0..2**(k+1) steps up.
    depth = max(n - 1, 0) if max_depth is None else min(max_depth, max(n - 1, 0))
    for _ in range(max(depth - 1, 0).bit_length()):
        anc = anc | torch.gather(anc, 1, jump[:, :, None].expand(num_trees, n, n))
        jump = torch.gather(jump, 1, jump)
    return anc


def build_tree_mask(
    parents: Sequence[torch.Tensor],  # num_seqs x [tree_len_s] int, on one device
    *,
    max_tree_len: int | None = None,
) -> TreeMask:
    """Flattened tree fields for a batch: one parent array per sequence, in batch order
    (an empty one for a sequence without a tree: a plain decode or a prefill chunk).

    ``max_tree_len`` raises the host bound above the largest tree (a CUDA graph captures
    with the largest it will replay). Parents are not validated here, since that would
    read them back to the host; ``check_parents`` does.
    """
    if not parents:
        raise ValueError("no sequences: pass one parent array per sequence")
    device = parents[0].device
    lens = [p.shape[0] for p in parents]
    bound = max(lens) if max_tree_len is None else max_tree_len
    if bound < max(lens):
        raise ValueError(f"max_tree_len {max_tree_len} < the largest tree ({max(lens)} nodes)")
    padded = torch.nn.utils.rnn.pad_sequence(
        [p.to(device=device, dtype=torch.int64) for p in parents], batch_first=True
    )  # [num_seqs, n]; padding 0 points at the root, harmless
    n = padded.shape[1]
    anc = ancestor_closure(padded).flatten()  # [num_seqs * n * n]

    tree_lens = torch.tensor(lens, dtype=torch.int64, device=device)  # [num_seqs]
    sizes = tree_lens * tree_lens
    offsets = torch.cumsum(sizes, 0) - sizes  # [num_seqs]
    total = sum(t * t for t in lens)
    # Entry e of the flat output belongs to sequence seq[e], at (row, col) of its [t, t].
    seq = torch.repeat_interleave(
        torch.arange(len(lens), device=device), sizes, output_size=total
    )  # [total]
    within = torch.arange(total, device=device) - offsets[seq]
    t = tree_lens[seq]
    flat = anc[(seq * n + within // t) * n + within % t]  # [total] bool
    return TreeMask(
        tree_lens=tree_lens.to(torch.int32),
        tree_mask_offsets=offsets,
        tree_mask=flat,
        max_tree_len=bound,
    )


def check_parents(parents: torch.Tensor) -> None:  # [tree_len] int
    """Raise unless ``parents`` describes a tree in node order (reads it to the host)."""
    values = parents.tolist()
    if values and values[0] != 0:
        raise ValueError(f"root's parent is {values[0]}; the root (node 0) must be its own parent")
    for i, p in enumerate(values[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(
                f"node {i} has parent {p}; parents must precede their children (0 <= p < {i})"
            )
