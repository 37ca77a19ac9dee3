"""The one result type of acceptance (``Acceptance``), the K/V moves that compact its
accepted paths (``accepted_path_moves``), and greedy acceptance of a batch of equally
shaped draft trees as device ops (no sync, capturable) with the pipelined step's catch-up
staging around it: the reference of the one-launch kernel ``kernels.accept`` and what the
engine runs without it. Acceptance of any trees, greedy or sampled, is
``specdec.spec.acceptance``; every function there returns an ``Acceptance`` too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class AcceptedRow(NamedTuple):
    """One row of an ``Acceptance`` read on the host: ``accepted_nodes`` are tree node
    indices along the accepted path, root excluded; ``token_ids`` are what the step emits
    (the accepted draft tokens, then the bonus), so ``len(token_ids) == num_accepted + 1``."""

    accepted_nodes: list[int]
    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def bonus_token_id(self) -> int:
        return self.token_ids[-1]


@dataclass
class Acceptance:
    """One verification step's outcome for a batch of draft trees: what every acceptance
    function returns (greedy or sampled, trees of any sizes, tensors on the device or the
    host), what ``accepted_path_moves`` compacts the K/V by, and what ``tolist`` reads
    back in one sync.

    Row ``b``'s accepted path is ``path[b, 1 : num_accepted[b] + 1]`` (tree node indices
    by depth; ``path[b, 0] == 0`` is the root) and the step emits ``token_ids[b, :
    num_accepted[b] + 1]`` (the accepted tokens, then the bonus). ``width`` is at least
    the deepest tree's depth + 1. Entries past those are padding (node 0, arbitrary
    tokens): consumers mask them with ``num_accepted``.
    """

    num_accepted: torch.Tensor  # [batch] int64
    path: torch.Tensor  # [batch, width] int64: accepted node at each depth
    token_ids: torch.Tensor  # [batch, width] int64: emitted tokens

    @property
    def width(self) -> int:
        return self.path.shape[1]

    @property
    def bonus_token_ids(self) -> torch.Tensor:  # [batch] int64
        return self.token_ids.gather(1, self.num_accepted[:, None]).squeeze(1)

    def to(self, device: torch.device) -> Acceptance:
        return Acceptance(
            num_accepted=self.num_accepted.to(device),
            path=self.path.to(device),
            token_ids=self.token_ids.to(device),
        )

    def tolist(self) -> list[AcceptedRow]:
        """Every row on the host (one sync for device tensors)."""
        width = self.width
        packed = torch.cat([self.num_accepted[:, None], self.path, self.token_ids], dim=1)
        rows = []
        for r in packed.tolist():  # sync
            n = r[0]
            rows.append(AcceptedRow(r[2 : n + 2], r[1 + width : 1 + width + n + 1]))
        return rows


def accepted_path_moves(
    acceptance: Acceptance,  # of a batch of trees, on the slots' device
    slots: torch.Tensor,  # [batch, q >= width] int64: the slots of each tree's nodes (root first)
) -> tuple[torch.Tensor, torch.Tensor]:  # src, dst: [batch, width - 1] int64
    """The K/V moves (``ModelRunner.move_kv``) that put each row's accepted path next to
    its root: the accepted node at depth ``d`` moves to the slot of node ``d`` (cache index
    root + d). Device ops only; depths past a row's accepted count copy a slot onto itself
    (no host-side filtering), which no real move reads or writes (their targets are node
    ``d``'s slots for smaller ``d``). A tree of fewer than ``width`` nodes pads its slots
    with its root's, which no real move reads or writes either."""
    path, num_accepted = acceptance.path, acceptance.num_accepted  # [batch, width]
    depth = torch.arange(1, path.shape[1], device=path.device)  # [width - 1]
    src_node = torch.where(depth <= num_accepted[:, None], path[:, 1:], depth)
    return slots.gather(1, src_node), slots[:, 1 : path.shape[1]]


def greedy_accept_argmax(
    token_ids: torch.Tensor,  # [batch, q] int64
    parents: torch.Tensor,  # [batch, q] int64
    depths: torch.Tensor,  # [batch, q] int64
    best: torch.Tensor,  # [batch, q] int64: the target's argmax at each node
    max_depth: int,
) -> Acceptance:
    """Greedy acceptance of a batch of trees of ``q`` nodes each (``spec.acceptance.
    greedy_accept_batch`` pads smaller trees to this) from the target's argmax per node:
    a node passes when its token is its parent's argmax, and is accepted when it and all
    its ancestors pass (pointer jumping). At most one child per node passes, so the
    accepted nodes have distinct depths 1 .. a: scattering each to its depth gives the
    path. Device ops only (capturable); the one-launch kernel ``kernels.accept`` takes the
    same inputs."""
    batch, q = token_ids.shape
    on_path = token_ids == best.gather(1, parents)
    on_path[:, 0] = True  # the root passes (its own parent), so chains of passes reach it
    jump = parents
    # After round r a node has checked itself and its 2**r - 1 nearest ancestors; a node
    # at depth <= max_depth needs max_depth of them (the root passes).
    for _ in range(max(min(max_depth, q - 1) - 1, 0).bit_length()):
        on_path = on_path & on_path.gather(1, jump)
        jump = jump.gather(1, jump)
    on_path[:, 0] = False
    num_accepted = on_path.sum(dim=1)  # [batch]
    # Accepted node i goes to column depths[i]; the rest to a spare column, dropped.
    column = torch.where(on_path, depths, max_depth + 1)
    nodes = torch.arange(q, device=token_ids.device).expand(batch, q)
    path = torch.zeros(batch, max_depth + 2, dtype=torch.int64, device=token_ids.device)
    path = path.scatter(1, column, nodes)[:, : max_depth + 1]  # [batch, depth + 1]
    last = path.gather(1, num_accepted[:, None])  # [batch, 1]: the deepest accepted node
    bonus = best.gather(1, last)  # [batch, 1]: the target's argmax there
    # Accepted tokens by depth (columns 0 .. depth - 1), padded to depth + 1 columns; the
    # bonus then goes to column num_accepted, right after the accepted ones.
    emitted = torch.cat([token_ids.gather(1, path[:, 1:]), bonus], dim=1)
    emitted = emitted.scatter(1, num_accepted[:, None], bonus)
    return Acceptance(num_accepted=num_accepted, path=path, token_ids=emitted)


def greedy_accept_and_stage(
    best: torch.Tensor,  # [batch, q] int64: argmax of each node's target logits
    token_ids: torch.Tensor,  # [batch, q] int64
    parents: torch.Tensor,  # [batch, q] int64
    depths: torch.Tensor,  # [batch, q] int64
    max_depth: int,
    aux: torch.Tensor,  # [batch * q, A]: the target's aux states at every node
    root_index: torch.Tensor,  # [batch] int64
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # rows >= batch
) -> tuple[Acceptance, torch.Tensor]:
    """The pipelined speculative step's acceptance (``greedy_accept_argmax``), its next
    catch-up state written into rows ``0 .. batch`` of ``state`` (tokens [rows, W], aux
    [rows, W, A] gathered along each path, last [rows], start [rows]; columns ``0 ..
    depth + 1`` of the W >= depth + 1, the rest untouched) and the packed read-back row
    [batch, depth + 2] (num_accepted, then the emitted tokens). Torch ops only
    (capturable); the reference of ``kernels.accept.accept_and_stage``."""
    batch, q = token_ids.shape
    d1 = max_depth + 1
    acceptance = greedy_accept_argmax(token_ids, parents, depths, best, max_depth)
    path = acceptance.path[:, :, None].expand(-1, -1, aux.shape[1])
    tokens, st_aux, last, start = state
    tokens[:batch, :d1].copy_(acceptance.token_ids)
    st_aux[:batch, :d1].copy_(aux.view(batch, q, -1).gather(1, path))
    last[:batch].copy_(acceptance.num_accepted)
    start[:batch].copy_(root_index)
    packed = torch.cat([acceptance.num_accepted[:, None], acceptance.token_ids], dim=1)
    return acceptance, packed
