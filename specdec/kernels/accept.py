"""Greedy acceptance of a batch of equally shaped draft trees and the pipelined step's
catch-up state, in one launch (Triton), next to the PyTorch reference.

After the verify forward the pipelined speculative step (spec/pipeline.py) finds,
per tree, the nodes whose token is their parent's argmax all the way from the root, the
accepted path by depth, the emitted tokens (accepted, then the bonus), and then writes the
next step's catch-up state: those tokens, the target's aux states gathered along the path,
the accepted count and the root's cache index. As torch ops
(``ops.accept.greedy_accept_and_stage``: acceptance, the aux gather, the state copies
and the packed read-back row) that is ~25 small kernels per step, where a step on the GPU
is launch-bound (~2-3 µs a kernel). This kernel does all of it after the argmax: one
program per tree.

Acceptance without in-register gathers: a node is accepted iff it and each of its first
``max_depth`` ancestors pass (the root passes); the ancestors are walked through the
parents table in global memory, ``max_depth`` loads deep (trees are no deeper).

Outputs equal the reference's exactly, padding included (``Acceptance``'s
contract: path entries past the accepted count are node 0; emitted entries past the bonus
are the root's token, the last column the bonus).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import next_power_of_2, require_launchable
from specdec.ops.accept import Acceptance
from specdec.ops.accept import greedy_accept_and_stage as accept_and_stage_ref

__all__ = ["accept_and_stage", "accept_and_stage_ref"]


@triton.jit
def _accept_stage_kernel(
    best_ptr,  # [batch, q] int64: the target's argmax at each node
    tokens_ptr,  # [batch, q] int64
    parents_ptr,  # [batch, q] int64
    depths_ptr,  # [batch, q] int64
    aux_ptr,  # [batch * q, A]
    root_ptr,  # [batch] int64: each root's cache index
    num_acc_ptr,  # out [batch] int64
    path_ptr,  # out [batch, D1] int64
    emitted_ptr,  # out [batch, D1] int64
    packed_ptr,  # out [batch, D1 + 1] int64: num_accepted, then the emitted tokens
    st_tokens_ptr,  # out state rows [rows, W] int64 (W >= D1: entries past D1 untouched)
    st_aux_ptr,  # out state rows [rows, W, A]
    st_last_ptr,  # out [rows] int64
    st_start_ptr,  # out [rows] int64
    aux_width,
    state_width,  # W
    Q: tl.constexpr,
    DEPTH: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    base = b * Q
    D1: tl.constexpr = DEPTH + 1
    offs = tl.arange(0, BLOCK_Q)
    ok = offs < Q
    # A node passes when its token is its parent's argmax; the root always passes.
    accepted = ok
    cur = offs
    for _ in tl.static_range(DEPTH):
        par = tl.load(parents_ptr + base + cur, mask=ok, other=0)
        tok = tl.load(tokens_ptr + base + cur, mask=ok, other=0)
        best_par = tl.load(best_ptr + base + par, mask=ok, other=-1)
        accepted = accepted & ((cur == 0) | (tok == best_par))
        cur = par
    accepted = accepted & (offs > 0)
    num_acc = tl.sum(accepted.to(tl.int64), axis=0)
    # The accepted node at each depth (distinct depths 1 .. num_acc; node 0 elsewhere).
    dep = tl.load(depths_ptr + base + offs, mask=ok, other=-1)
    d = tl.arange(0, BLOCK_D)
    sel = accepted[None, :] & (dep[None, :] == d[:, None])  # [BLOCK_D, BLOCK_Q]
    path = tl.sum(tl.where(sel, offs[None, :], 0), axis=1).to(tl.int64)  # [BLOCK_D]
    last = tl.sum(tl.where(d == num_acc, path, 0), axis=0)
    bonus = tl.load(best_ptr + base + last)
    # Emitted: the token of the next depth's path node (node 0 past the path), the bonus
    # in the last column and at column num_acc (the reference's padding, exactly).
    sel_next = accepted[None, :] & (dep[None, :] == d[:, None] + 1)
    path_next = tl.sum(tl.where(sel_next, offs[None, :], 0), axis=1).to(tl.int64)
    d_ok = d < D1
    emitted = tl.load(tokens_ptr + base + path_next, mask=d_ok, other=0)
    emitted = tl.where((d == DEPTH) | (d == num_acc), bonus, emitted)
    tl.store(path_ptr + b * D1 + d, path, mask=d_ok)
    tl.store(emitted_ptr + b * D1 + d, emitted, mask=d_ok)
    tl.store(num_acc_ptr + b, num_acc)
    tl.store(packed_ptr + b * (D1 + 1), num_acc)
    tl.store(packed_ptr + b * (D1 + 1) + 1 + d, emitted, mask=d_ok)
    # The next step's catch-up state, row b.
    tl.store(st_tokens_ptr + b * state_width + d, emitted, mask=d_ok)
    tl.store(st_last_ptr + b, num_acc)
    tl.store(st_start_ptr + b, tl.load(root_ptr + b))
    offs_a = tl.arange(0, BLOCK_A)
    for j in tl.static_range(D1):
        node = tl.sum(tl.where(d == j, path, 0), axis=0)
        src = aux_ptr + (base + node) * aux_width
        dst = st_aux_ptr + (b * state_width + j) * aux_width
        for a0 in range(0, aux_width, BLOCK_A):
            a_ok = a0 + offs_a < aux_width
            tl.store(dst + a0 + offs_a, tl.load(src + a0 + offs_a, mask=a_ok), mask=a_ok)


def accept_and_stage(
    best: torch.Tensor,
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    max_depth: int,
    aux: torch.Tensor,
    root_index: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[Acceptance, torch.Tensor]:
    """``accept_and_stage_ref`` in one launch."""
    batch, q = token_ids.shape
    tokens, st_aux, last, start = state
    d1 = max_depth + 1
    width = tokens.shape[1]
    if width < d1 or st_aux.shape[1] != width or st_aux.shape[2] != aux.shape[1]:
        raise ValueError(
            f"state rows must be [rows, W >= {d1}] tokens and [rows, W, {aux.shape[1]}] aux; "
            f"got {tuple(tokens.shape)} and {tuple(st_aux.shape)}"
        )
    if not (tokens.is_contiguous() and st_aux.is_contiguous()):
        raise ValueError("the catch-up state's tokens and aux rows must be contiguous")
    if tokens.shape[0] < batch or aux.shape[0] != batch * q:
        raise ValueError(
            f"{batch} trees of {q} nodes need >= {batch} state rows and {batch * q} aux rows; "
            f"got {tokens.shape[0]} and {aux.shape[0]}"
        )
    tensors = (best, token_ids, parents, depths, aux, root_index, tokens, st_aux, last, start)
    require_launchable(_accept_stage_kernel, *tensors)
    device = token_ids.device
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    path = torch.empty(batch, d1, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, d1, dtype=torch.int64, device=device)
    packed = torch.empty(batch, d1 + 1, dtype=torch.int64, device=device)
    if batch:
        _accept_stage_kernel[(batch,)](
            best.contiguous(),
            token_ids.contiguous(),
            parents.contiguous(),
            depths.contiguous(),
            aux.contiguous(),
            root_index.contiguous(),
            num_accepted,
            path,
            emitted,
            packed,
            tokens,
            st_aux,
            last,
            start,
            aux.shape[1],
            width,
            Q=q,
            DEPTH=max_depth,
            BLOCK_Q=next_power_of_2(q),
            BLOCK_D=next_power_of_2(d1),
            BLOCK_A=min(1024, next_power_of_2(aux.shape[1])),
        )
    return Acceptance(num_accepted=num_accepted, path=path, token_ids=emitted), packed
