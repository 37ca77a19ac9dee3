"""Draft steps over a tree: one proposer forward per tree level, on the proposer's paged
cache.

A model proposer (EAGLE head, draft model) grows its trees level by level
(``build_trees``). Each call feeds one level's nodes; a node attends to the request's
cached context and to its own ancestors among the nodes fed before it. ``TreeDraftLayout``
lays the fed nodes of a batch of trees out in each request's lookahead slots, level after
level from cache index ``start``, and builds each level's varlen inputs: slots, RoPE
positions (every node of level ``d`` sits at position ``start + d - 1``) and the tree mask
of the forest the fed nodes form. The forest's roots are the level-1 nodes: the tree's
own root is part of the cached context, below ``start``.

Fed entries are scratch. They occupy slots the target's verification overwrites, and a
proposer counts as cached only what it re-validates afterwards (``chain_prefix``).
Everything is built on device from sizes the host knows; nothing is read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.attention.metadata import AttentionMetadata
from specdec.engine.request import Request
from specdec.spec.chunk_inputs import ChunkInputs


class TreeDraftLayout:
    """Where the fed nodes of ``len(requests)`` trees (one per request, same shape) live.

    ``start[b]`` is request ``b``'s cache index (and RoPE position) for its level-1 nodes;
    the request's blocks must hold ``start[b] + num_fed`` slots once every level is fed
    (a shape's ``num_expanded`` nodes).
    """

    def __init__(
        self,
        requests: Sequence[Request],
        start: Sequence[int],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.start_cpu = list(start)
        width = max(len(r.block_ids) for r in requests)
        tables = torch.zeros(len(requests), width, dtype=torch.int32)
        for row, request in enumerate(requests):
            tables[row, : len(request.block_ids)] = torch.tensor(request.block_ids)
        self.block_tables = tables.to(device)  # [batch, width]
        self.start = torch.tensor(self.start_cpu, dtype=torch.int64).to(device)  # [batch]
        self.num_fed = 0  # nodes fed so far per tree (levels are equally wide across trees)
        self.mask: torch.Tensor | None = None  # [batch, num_fed, num_fed] bool
        self.levels: list[torch.Tensor] = []  # per fed level: [batch, n] token ids
        self._level_offset = 0  # first fed index of the last level

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    def level(
        self,
        tokens: torch.Tensor,  # [batch, n] int64: the nodes of this level
        parent_rows: torch.Tensor,  # [batch, n] int64: rows of the previous level
        depth: int,  # the nodes' depth in the tree (>= 1)
    ) -> ChunkInputs:
        """Inputs that feed ``tokens`` (``build_trees``' arguments for depth >= 1)."""
        batch, n = tokens.shape
        if depth != len(self.levels) + 1:
            raise ValueError(
                f"levels are fed in order: got depth {depth}, expected {len(self.levels) + 1}"
            )
        device = self.device
        prev, total = self.num_fed, self.num_fed + n
        # Mask rows: a level-1 node sees itself; a deeper node its parent's row plus itself.
        mask = torch.zeros(batch, total, total, dtype=torch.bool, device=device)
        if prev:
            assert self.mask is not None
            mask[:, :prev, :prev] = self.mask
            if depth > 1:
                rows = self._level_offset + parent_rows.to(device)  # [batch, n]
                mask[:, prev:, :prev] = self.mask.gather(1, rows[:, :, None].expand(batch, n, prev))
        mask[:, prev:, prev:] |= torch.eye(n, dtype=torch.bool, device=device)

        bs = self.block_size
        index = self.start[:, None] + prev + torch.arange(n, device=device)  # [batch, n]
        blocks = self.block_tables.gather(1, index // bs).long()  # [batch, n]
        slots = (blocks * bs + index % bs).flatten()  # [batch * n]
        positions = (self.start + depth - 1)[:, None].expand(batch, n).flatten()
        seq_lens_cpu = [s + total for s in self.start_cpu]
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device),
            seq_lens=(self.start + total).to(torch.int32),
            block_tables=self.block_tables,
            max_query_len=n,
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=[n] * batch,
            seq_lens_cpu=seq_lens_cpu,
            tree_lens=torch.full((batch,), total, dtype=torch.int32, device=device),
            tree_mask_offsets=torch.arange(batch, device=device) * (total * total),
            tree_mask=mask.flatten(),
            max_tree_len=total,
        )
        self.mask, self._level_offset, self.num_fed = mask, prev, total
        self.levels.append(tokens)
        return ChunkInputs(
            input_ids=tokens.flatten(),
            positions=positions,
            meta=meta,
            last_rows=torch.arange(batch * n, device=device),
        )

    def chain_prefix(self) -> list[list[int]]:
        """Per request, the fed tokens at cache indices ``start, start + 1, ...`` that form
        one path from the root: row 0 of each level while levels are one node wide, then
        row 0 of the first wider level. A draft model's cache is valid there exactly where
        these tokens equal what the request ends up holding (one host sync)."""
        taken: list[torch.Tensor] = []
        for tokens in self.levels:
            taken.append(tokens[:, 0])
            if tokens.shape[1] > 1:
                break
        if not taken:
            return [[] for _ in range(self.batch)]
        return torch.stack(taken, dim=1).tolist()
