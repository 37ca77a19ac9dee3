"""``SpecDecodeMetadata``: one step's draft trees, flattened for the verify forward.

The contract between the three parts of speculation: the proposer hands over one
``DraftTree`` per request; the verifier feeds every tree's nodes to the target in one
forward (request after request, each tree in node order, root first) and gathers the
output rows named by ``logits_indices``; acceptance reads those rows tree by tree
(``accept_batch``). With speculation off every tree is just its root, and the step is a
plain decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.spec.tree import DraftTree


@dataclass
class SpecDecodeMetadata:
    """Invariants: ``node_offsets[0] == 0``, ``node_offsets[b + 1] - node_offsets[b] ==
    num_nodes[b] == trees[b].num_nodes``, ``node_offsets[-1] == total_nodes``. Request b's
    nodes are entries ``node_offsets[b] ... node_offsets[b + 1] - 1`` of every flat tensor,
    in tree order; ``parents`` are tree-local (add ``node_offsets[b]`` for flat indices).
    """

    trees: list[DraftTree]  # per request; acceptance needs them (sampled trees' draft_probs)
    num_nodes: list[int]  # per request, root included (host)
    node_offsets: torch.Tensor  # [num_reqs + 1] int64: cumulative num_nodes
    token_ids: torch.Tensor  # [total_nodes] int64: each node's token (root = last committed)
    parents: torch.Tensor  # [total_nodes] int64: tree-local parent index (root: 0)
    depths: torch.Tensor  # [total_nodes] int64: 0 at the root
    logits_indices: torch.Tensor  # [total_nodes] int64: node's row in the verify output

    def __post_init__(self) -> None:
        total = sum(self.num_nodes)
        if (
            len(self.trees) != len(self.num_nodes)
            or self.node_offsets.shape[0] != len(self.num_nodes) + 1
        ):
            raise ValueError(
                f"{len(self.trees)} trees, {len(self.num_nodes)} node counts and "
                f"{self.node_offsets.shape[0]} offsets; expected one tree and count per "
                "request and num_reqs + 1 offsets (use SpecDecodeMetadata.from_trees)"
            )
        for name in ("token_ids", "parents", "depths", "logits_indices"):
            if getattr(self, name).shape != (total,):
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}; expected "
                    f"[{total}] (sum of num_nodes)"
                )

    @property
    def num_reqs(self) -> int:
        return len(self.num_nodes)

    @property
    def total_nodes(self) -> int:
        return self.token_ids.shape[0]

    @property
    def max_draft_tokens(self) -> int:
        """Largest number of draft nodes (root excluded) any request verifies this step."""
        return max(self.num_nodes) - 1

    @classmethod
    def from_trees(
        cls,
        trees: list[DraftTree],
        query_start: list[int],  # per request: row of its root in the verify forward
        device: torch.device | str,
    ) -> SpecDecodeMetadata:
        """Flatten ``trees``. Request b's tree occupies verify rows ``query_start[b] ...
        query_start[b] + num_nodes[b] - 1`` in node order (where the engine lays them)."""
        if not trees:
            raise ValueError("no trees; a speculative step needs at least one request")
        if len(query_start) != len(trees):
            raise ValueError(
                f"got {len(query_start)} query starts for {len(trees)} trees; pass one "
                "verify row (the root's) per request"
            )
        num_nodes = [t.num_nodes for t in trees]
        offsets = [0]
        for n in num_nodes:
            offsets.append(offsets[-1] + n)
        logits_indices = [
            start + i for start, n in zip(query_start, num_nodes, strict=True) for i in range(n)
        ]
        return cls(
            trees=trees,
            num_nodes=num_nodes,
            node_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
            token_ids=torch.cat([t.token_ids.to(device) for t in trees]),
            parents=torch.cat([t.parents.to(device) for t in trees]),
            depths=torch.cat([t.depths.to(device) for t in trees]),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        )

    def positions(
        self,
        prefix_lens: torch.Tensor,  # [num_reqs] int64: tokens before each root
    ) -> torch.Tensor:  # [total_nodes] int64
        """Each node's sequence position: its request's prefix length plus its depth."""
        per_node = prefix_lens.repeat_interleave(
            torch.tensor(self.num_nodes, device=prefix_lens.device),
            output_size=self.total_nodes,
        )
        return per_node + self.depths
