"""The one description of a forward's attention work: which cache slots each new token
writes and which cached context each query reads.

Cache layout (every backend, every layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A *slot* is ``block_id * block_size +
offset``. Block 0 is the null block: the block pool never hands it out, so padded tokens
(CUDA-graph batch padding) write there and padded sequences read it, harmlessly.

Sequences in a batch are laid out back to back (varlen). Sequence ``s`` contributes
``q_len = query_start_loc[s+1] - query_start_loc[s]`` new tokens and has ``seq_lens[s]``
tokens of context *including* them, so its new tokens sit at absolute positions
``seq_lens[s] - q_len ... seq_lens[s] - 1`` and query ``i`` attends causally to keys
``0 ... seq_lens[s] - q_len + i``. Decode is the case ``q_len == 1``.

Draft trees. The last ``t = tree_lens[s]`` tokens of sequence ``s``'s context may form a
tree (``t == 0``: no tree, the causal rule alone). In verification they are the step's last
``t`` new tokens; in a proposer's draft step, which adds one level to a tree whose earlier
levels are already cached, ``t`` exceeds ``q_len`` and the queries are the tree's last
``q_len`` nodes (several "roots" whose parent is themselves make the tree a forest). Tree
nodes occupy consecutive cache indices ``seq_lens[s] - t ... seq_lens[s] - 1`` in node
order, parents before children.
``tree_mask[tree_mask_offsets[s] :][: t * t]`` is that tree's row-major ``[t, t]`` matrix
with ``mask[i, j]`` true iff node ``j`` is node ``i`` or one of its ancestors. A query of
tree node ``i`` sees every key at cache index ``< seq_lens[s] - t`` (the committed context
and any earlier new tokens of the step) plus the tree keys ``j`` with ``mask[i, j]``;
queries before the tree part keep the causal rule. Equivalently, for every query at cache
index ``p`` and key at ``k``: visible iff ``k <= p`` and (``k`` is outside the tree or the
mask bit is set), so bits above the diagonal (impossible in a valid tree) are ignored.
Attention works on cache indices only: tree nodes' RoPE positions (prefix length + depth)
reach the model through its ``positions`` input, not through this metadata. A batch may mix
trees, plain decodes and prefill chunks; ``specdec.attention.tree_mask`` builds the fields
from parent arrays.

Logical positions (optional ``tree_paths``/``tree_depths``, read by the batch-invariant
kernel ``specdec.kernels.invariant_attention``). A query's visible keys, in the order that
kernel reduces them, are its *logical positions* ``0 .. n - 1``. A query outside a tree at
cache index ``p`` has ``n = p + 1`` and logical position ``l`` is cache index ``l``. A query
of tree node ``i`` (tree of ``t`` nodes starting at cache index ``r = seq_lens[s] - t``)
sees the ``r`` keys before the tree at their own indices, then its visible tree nodes in
node order, which is depth order: logical position ``r + k`` is cache index ``r +
tree_paths[s, i, k]`` for ``k = 0 .. tree_depths[s, i]``, so ``n = r + tree_depths[s, i] +
1``. An accepted node at depth ``d`` thus reads the same keys at the same logical
positions as the token at cache index ``r + d`` of plain decoding. ``ops.tree_paths``
builds both tables from the tree mask with device ops.

Query tiles (optional ``tile_starts``/``tile_seqs``, read by the batch-invariant kernel):
a sequence's query rows before its tree go in tiles of up to ``TILE_TOKENS`` consecutive
rows, its tree rows in tiles of their own of up to ``TREE_TILE_TOKENS``; ``tile_starts[s]``
is sequence ``s``'s first tile, ``tile_starts[num_seqs]`` the tile count, and
``tile_seqs[i]`` tile ``i``'s sequence (``num_seqs`` past the last tile; one entry per
query row, a bound on the tile count).
``ops.query_tiles`` builds both with device ops, once per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def cache_slots(
    block_tables: torch.Tensor,  # [num_seqs, width] int32
    index: torch.Tensor,  # [num_seqs, n] int64: cache indices within each sequence
    block_size: int,
) -> torch.Tensor:  # [num_seqs * n] int64
    """The slots of cache indices, through each sequence's block table (device ops)."""
    blocks = block_tables.gather(1, index // block_size).long()
    return (blocks * block_size + index % block_size).flatten()


def request_slots(
    block_ids: Sequence[int],  # one request's blocks, in order
    index: np.ndarray,  # [n] int: cache indices within the request
    block_size: int,
) -> np.ndarray:  # [n] int64
    """``cache_slots`` of one request on the host, from its block list."""
    return np.asarray(block_ids, dtype=np.int64)[index // block_size] * block_size + (
        index % block_size
    )


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs. Tensors live on the model's device.

    Invariants: ``query_start_loc[0] == 0``, ``query_start_loc[-1] == num_tokens``,
    ``1 <= q_len <= seq_lens[s]``, ``seq_lens[s] <= block_tables.shape[1] * block_size``.
    ``max_query_len``/``max_seq_len`` are host ints (grid sizes; no device sync needed) and
    are upper bounds: a CUDA graph captures with the largest values it will ever replay.
    Tree fields (module docstring): the three tensors come together or not at all,
    ``tree_lens[s] <= seq_lens[s]``, and ``max_tree_len`` bounds every ``tree_lens[s]``; with
    ``max_tree_len == 0`` the tensors are ignored and every query is causal.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies for the reference backend (it loops over sequences); None under CUDA graphs.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Draft-tree verification (module docstring); None: no trees in this batch.
    tree_lens: torch.Tensor | None = None  # [num_seqs] int32: tree nodes at the end of q
    tree_mask_offsets: torch.Tensor | None = None  # [num_seqs] int64: seq s's mask start
    tree_mask: torch.Tensor | None = None  # [sum_s tree_lens[s]**2] bool, row-major [t, t]
    max_tree_len: int = 0  # host bound on tree_lens
    # Logical positions of tree queries (module docstring); None: not built. Entries past a
    # row's depth, and rows past a tree's length, are unspecified.
    tree_paths: torch.Tensor | None = None  # [num_seqs, max_tree_len, max_tree_len] int32
    tree_depths: torch.Tensor | None = None  # [num_seqs, max_tree_len] int32
    # Query tiles (module docstring); None: not built.
    tile_starts: torch.Tensor | None = None  # [num_seqs + 1] int32
    tile_seqs: torch.Tensor | None = None  # [num_tokens] int64

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("tree_lens", "tree_mask_offsets", "tree_mask")
            if getattr(self, name) is not None
        ]
        if given and len(given) != 3:
            raise ValueError(
                f"tree fields come together: got only {given}; pass tree_lens, "
                "tree_mask_offsets and tree_mask (specdec.attention.tree_mask builds them)"
            )
        if self.max_tree_len < 0 or (self.max_tree_len > 0 and not given):
            raise ValueError(
                f"max_tree_len {self.max_tree_len} needs the tree tensors and must be >= 0"
            )
        paths = [n for n in ("tree_paths", "tree_depths") if getattr(self, n) is not None]
        if paths and (len(paths) != 2 or not given):
            raise ValueError(
                f"got {paths} without {'the tree fields' if not given else 'its partner'}; "
                "build tree_paths and tree_depths together from the tree fields "
                "(specdec.ops.tree_paths.with_tree_paths)"
            )

        if (self.tile_starts is None) != (self.tile_seqs is None):
            raise ValueError(
                "tile_starts and tile_seqs come together: build both with "
                "specdec.ops.query_tiles.with_query_tiles"
            )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def has_tree(self) -> bool:
        """Some sequence may verify a draft tree (its queries need the tree mask)."""
        return self.tree_lens is not None and self.max_tree_len > 0

    @property
    def has_tree_paths(self) -> bool:
        """The logical-position tables of the trees are attached."""
        return self.tree_paths is not None

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has exactly one new token and no tree (the decode kernel's case)."""
        return self.max_query_len == 1 and not self.has_tree
