"""Host-side assembly of one step's model inputs from the scheduler's decision.

Everything is built with numpy on the host and moved to the device in two packed copies
(one int64, one int32) through pinned staging (``specdec.device.staging``), so building a
step never waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specdec.attention.tree_mask import TreeMask, build_tree_mask
from specdec.device.staging import to_device, to_device_packed
from specdec.engine.cuda_graph import GraphStaging
from specdec.engine.scheduler import ScheduledRequest
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.step_inputs import BlockTables, PendingTokens, StepInputs, block_table_array
from specdec.spec.tree import DraftTree, cat_on

_NO_TREE = torch.empty(0, dtype=torch.int64)


def _tree_mask(
    scheduled: list[ScheduledRequest],
    trees: dict[int, DraftTree],
    tree_parents: list[torch.Tensor],
    q_lens: list[int],
    device: torch.device,
) -> TreeMask:
    """The batch's tree-mask fields. When every row is an unpadded tree that carries its
    ancestor mask (growth computed it on device) the masks are concatenated (one copy);
    otherwise they are rebuilt from the parent arrays."""
    masks = [trees[row].ancestor_mask if row in trees else None for row in range(len(scheduled))]
    if any(m is None or m.shape[0] != q for m, q in zip(masks, q_lens, strict=True)):
        return build_tree_mask([p.to(device) for p in tree_parents])
    sizes = np.asarray(q_lens, dtype=np.int64) ** 2
    offsets = to_device(np.cumsum(sizes) - sizes, device)
    return TreeMask(
        tree_lens=to_device(np.asarray(q_lens, dtype=np.int32), device),
        tree_mask_offsets=offsets,
        tree_mask=torch.cat([m.flatten() for m in masks]).to(device, non_blocking=True),
        max_tree_len=max(q_lens),
    )


def _unknown_token(request_id: str, index: int, known: int) -> RuntimeError:
    return RuntimeError(
        f"request {request_id}: step reaches token {index} but only {known} are known and "
        "no step in flight sampled the next one"
    )


def _decode_rows(
    scheduled: list[ScheduledRequest], starts: list[int], pending: PendingTokens | None
) -> tuple[list[int], list[list[int]], list[int], list[int], list[int]]:
    """``build_step_inputs``'s per-row lists when every row computes one token and none
    verifies a tree: input ids, block-id lists, sampled rows, pending rows and their rows
    in ``pending`` (the general loop's values; row ``i`` is flat token ``i``)."""
    input_ids: list[int] = []
    table_rows: list[list[int]] = []
    sampled_rows: list[int] = []
    pending_rows: list[int] = []
    pending_src: list[int] = []
    pending_of = pending.rows if pending is not None else {}
    for row, (sched, start) in enumerate(zip(scheduled, starts, strict=True)):
        request = sched.request
        table_rows.append(request.block_ids)
        prompt, output = request.prompt_token_ids, request.output_token_ids
        n = len(prompt)
        known = n + len(output)
        if start < known:
            input_ids.append(prompt[start] if start < n else output[start - n])
        else:
            src = pending_of.get(request.request_id) if start == known else None
            if src is None:
                raise _unknown_token(request.request_id, start, known)
            pending_rows.append(row)
            pending_src.append(src)
            input_ids.append(0)  # placeholder: filled on the device
        if start + 1 == known + request.num_pending_tokens:
            sampled_rows.append(row)
    return input_ids, table_rows, sampled_rows, pending_rows, pending_src


def build_step_inputs(
    scheduled: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    block_table_width: int | None = None,
    trees: dict[int, DraftTree] | None = None,
    pad_trees_to: int | None = None,
    pending: PendingTokens | None = None,
    staging: Callable[[int, int], GraphStaging | None] | None = None,
    block_tables: BlockTables | None = None,
) -> StepInputs:
    """Flatten the scheduled requests into one varlen batch.

    A request is *sampled* when this step reaches its last known token (decode, or the
    final chunk of a prefill); partial prefill chunks produce no token. A row in ``trees``
    (a decoding request with a draft) computes its tree instead of its one token: node 0
    is that token, nodes sit at consecutive cache slots in node order with RoPE positions
    ``start + depth``, and every node's logits are returned (the verify step). Its
    ``num_new_tokens`` must equal the tree's node count.

    ``pad_trees_to=q``: when every row verifies a tree of at most ``q`` nodes and has cache
    slots for ``q``, each tree is padded to ``q`` tokens so the step has a CUDA graph's
    uniform shape. Fillers (token 0 at the root's position, children of the root) come
    after the tree's nodes; their K/V lands in lookahead slots the step trims, and their
    logits are never returned.

    A request whose last input token is pending (async scheduling) takes it from
    ``pending`` on the device; it is sampled when this step reaches
    ``num_tokens_with_pending``.

    ``staging(q, num_seqs)``: for a uniform step (every sequence computes ``q`` tokens),
    the CUDA graph's buffers to build the inputs in (``cuda_graph.GraphStaging``), or
    None; the returned tensors are then views of them (``StepInputs.staged``).

    ``block_tables``: the caller's ``BlockTables``, kept from step to step, which writes
    only the rows whose blocks changed (the same array as ``block_table_array``'s).
    """
    trees = trees or {}
    starts = [s.request.num_computed_tokens for s in scheduled]
    if pad_trees_to is not None and not (
        len(trees) == len(scheduled)
        and all(t.num_nodes <= pad_trees_to for t in trees.values())
        and all(
            len(s.request.block_ids) * block_size >= start + pad_trees_to
            for s, start in zip(scheduled, starts, strict=True)
        )
    ):
        pad_trees_to = None
    q_lens = [pad_trees_to or s.num_new_tokens for s in scheduled]
    seq_lens = [st + q for st, q in zip(starts, q_lens, strict=True)]
    num_tokens = sum(q_lens)
    width = block_table_width or max(len(s.request.block_ids) for s in scheduled)

    # Python lists first, one numpy conversion each at the end: per-row numpy calls cost
    # more than the work for the one-token rows that dominate decoding.
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] | np.ndarray = []
    table_rows: list[list[int]] = []
    logits_indices: list[int] = []
    sampled_rows: list[int] = []
    logits_counts: list[int] = []
    tree_parents: list[torch.Tensor] = []
    tree_list: list[DraftTree] = []
    tree_token_rows: list[int] = []
    pending_rows: list[int] = []  # flat rows whose input is a pending token
    pending_src: list[int] = []  # ... and its row in pending.token_ids
    decode_only = not trees and all(q == 1 for q in q_lens)
    if decode_only:  # the common step at large batch: per-row work kept to the minimum
        input_ids, table_rows, sampled_rows, pending_rows, pending_src = _decode_rows(
            scheduled, starts, pending
        )
        positions = starts
        logits_indices = sampled_rows  # one token per row: its flat row is its row
        logits_counts = [1] * len(sampled_rows)
    else:
        for row, (sched, start, q_len) in enumerate(zip(scheduled, starts, q_lens, strict=True)):
            request = sched.request
            blocks = request.block_ids
            table_rows.append(blocks)
            end = start + q_len
            tree = trees.get(row)
            if tree is not None:
                m = tree.num_nodes
                if m != sched.num_new_tokens:
                    raise ValueError(
                        f"row {row}: tree of {m} nodes, {sched.num_new_tokens} tokens scheduled"
                    )
                # Token ids and depths stay on the proposer's device: placeholders here (the
                # start, so positions = start + depth once the depths are added on device).
                first = len(positions)
                tree_token_rows += range(first, first + m)
                input_ids += [0] * q_len
                positions += [start] * q_len
                slot_mapping += [
                    blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
                ]
                logits_indices += range(first, first + m)
                sampled_rows.append(row)
                logits_counts.append(m)
                parents = tree.parents
                if q_len > m:  # fillers hang below the root
                    parents = torch.cat([parents, parents.new_zeros(q_len - m)])
                tree_parents.append(parents)
                tree_list.append(tree)
                continue
            tree_parents.append(_NO_TREE)
            known = len(request.prompt_token_ids) + len(request.output_token_ids)
            if q_len == 1 and start < known:  # a decode with its token known (synchronous)
                input_ids.append(request.token_id(start))
            elif end <= known:
                input_ids += request.token_ids(start, end)
            else:
                if pending is None or end != known + 1 or request.request_id not in pending.rows:
                    raise _unknown_token(request.request_id, end - 1, known)
                input_ids += request.token_ids(start, known)
                pending_rows.append(len(input_ids))
                pending_src.append(pending.rows[request.request_id])
                input_ids.append(0)  # placeholder: filled on the device below
            if q_len == 1:
                positions.append(start)
                slot_mapping.append(blocks[start // block_size] * block_size + start % block_size)
            else:
                pos = range(start, end)
                positions += pos
                slot_mapping += [blocks[p // block_size] * block_size + p % block_size for p in pos]
            if end == known + request.num_pending_tokens:
                logits_indices.append(len(positions) - 1)
                sampled_rows.append(row)
                logits_counts.append(1)
    if (
        block_tables is not None
        and len(table_rows) <= block_tables.rows
        and width <= block_tables.width
    ):
        table_array = block_tables.update(table_rows)[:, :width]  # [rows, width]
    else:
        table_array = block_table_array(table_rows, width)  # [rows, width]
    if decode_only:  # every row's one slot, from the table just built
        pos = np.asarray(starts, dtype=np.int64)
        blocks = table_array[np.arange(len(starts)), pos // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + pos % block_size

    query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    n, s = num_tokens, len(scheduled)
    q = q_lens[0]
    uniform = all(x == q for x in q_lens) and (
        (q == 1 and not tree_list) or len(tree_list) == len(scheduled)
    )
    stage = staging(q, s) if staging is not None and uniform else None
    # Token rows: ids, positions, slots, each `rows` long (a staged step pads them to its
    # graph's bucket: zeros, the null block's slot 0).
    rows = stage.bucket * q if stage is not None else n
    pad = np.zeros(rows - n, dtype=np.int64)
    # Two host-to-device copies per step (one per dtype) instead of one per tensor.
    packed64 = to_device(
        np.concatenate(
            [
                np.asarray(input_ids, dtype=np.int64),
                pad,
                np.asarray(positions, dtype=np.int64),
                pad,
                np.asarray(slot_mapping, dtype=np.int64),
                pad,
                np.asarray(
                    logits_indices + tree_token_rows + pending_rows + pending_src, dtype=np.int64
                ),
            ]
        ),
        device,
        stage.int64 if stage is not None else None,
    )
    num_logits = len(logits_indices)
    extra = 3 * rows + num_logits  # where the device-filled rows start in packed64
    if tree_list:
        tree_rows = packed64[extra : extra + len(tree_token_rows)]
        # Trees may live on the host (ngram, root-only) or the device (model proposers).
        tokens = cat_on(device, [t.token_ids for t in tree_list])
        depths = cat_on(device, [t.depths for t in tree_list])
        packed64[:n].index_copy_(0, tree_rows, tokens)
        packed64[rows : rows + n].index_add_(0, tree_rows, depths)
    if pending_rows:
        assert pending is not None
        k, first = len(pending_rows), extra + len(tree_token_rows)
        dst, src = packed64[first : first + k], packed64[first + k :]
        tokens = pending.token_ids
        # The usual case (every row of the step in flight again, in its order) needs no
        # gather: one kernel fewer per step, which counts at batch 1.
        if k != tokens.shape[0] or pending_src != list(range(k)):
            tokens = tokens.index_select(0, src)
        packed64[:n].index_copy_(0, dst, tokens)
    lens = np.asarray(seq_lens, np.int32)
    if stage is not None:  # padding sequences: q tokens of context on the null block
        lens = np.concatenate([lens, np.full(stage.bucket - s, q, dtype=np.int32)])
    lens_on, qsl, tables = to_device_packed(
        [lens, query_start_loc, table_array.ravel()],
        device,
        stage.int32 if stage is not None else None,
    )
    meta = AttentionMetadata(
        slot_mapping=packed64[2 * rows : 2 * rows + n],
        query_start_loc=qsl,
        seq_lens=lens_on[:s],
        block_tables=tables.view(s, width),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    if any(not t.is_chain for t in tree_list):
        # A chain is plain causal attention; only branching trees need the mask.
        meta = _tree_mask(scheduled, trees, tree_parents, q_lens, device).attach(meta)
    return StepInputs(
        input_ids=packed64[:n],
        positions=packed64[rows : rows + n],
        meta=meta,
        logits_indices=packed64[3 * rows : 3 * rows + num_logits],
        logits_counts=logits_counts,
        sampled_rows=sampled_rows,
        is_decode_only=max(q_lens) == 1 and not trees,
        uniform_q=q if uniform else None,
        staged=stage is not None,
    )
