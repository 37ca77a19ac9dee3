"""The pipelined speculative step: step N+1 is launched from step N's acceptance while it
is still on the device, and the host reads N while the device runs N+1 (docs/DESIGN.md,
"The pipelined speculative step").

A synchronous speculative step makes the device wait for the host twice: the host reads
the acceptance, then prepares the next draft and verification. Here everything that
links one step to the next stays on the device:

- the next root's cache index: ``r + num_accepted + 1`` (the host knows ``r``, the root
  of the step it last read);
- the head's catch-up: the emitted tokens, the aux states of the root and the accepted
  nodes, and ``last = num_accepted`` (``GrowInputs``' padded device tensors);
- the accepted path's K/V, moved next to the root by device index copies (trees);
- the verification's positions and slots: ``root + depth`` and the block table's slots
  from the root on.

The host keeps every request one step behind: when it launches step N+1 it knows
``num_computed_tokens = r_N`` (the root of the step in flight), so it reserves slots for
the worst case of both steps (``catch_up_width`` more than a synchronous step). Reading
step N then appends its tokens, checks stops and records ``r_{N+1}``; a request that N
stopped has N+1's work dropped, whose K/V lands in its own freed slots before any later
step can reuse them (the device runs steps in order).

Greedy requests of an EAGLE-3-style proposer only (``Proposer.pipelines``): sampled
acceptance, SpecExit, logprobs, prefills and admissions run the synchronous step, after
the step in flight is read (``LLMEngine`` decides per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.attention.metadata import AttentionMetadata, cache_slots
from specdec.attention.tree_mask import ancestor_closure, uniform_tree_mask
from specdec.engine.input_batch import StepInputs, block_table_array
from specdec.engine.request import Request
from specdec.engine.staging import HostCopy, to_device, to_host
from specdec.spec.acceptance import UniformAcceptance, greedy_accept_uniform
from specdec.spec.tree import TreeBatch
from specdec.spec.tree_draft import GrowInputs


@dataclass
class SpecLaunch:
    """A launched speculative step whose outcome the host has not read. Row ``b`` is
    ``requests[b]``; the device tensors feed the next launch, the host copy feeds
    ``read``."""

    requests: list[Request]
    num_draft_tokens: int  # per tree (all trees have one shape)
    acceptance: UniformAcceptance
    catch_up_aux: torch.Tensor  # [batch, depth + 1, aux width]: root, then accepted nodes
    _host: HostCopy  # [batch, depth + 2]: num_accepted, then the emitted tokens

    def read(self) -> list[list[int]]:
        """Per row: the tokens the step emitted (accepted, then the bonus). Waits for this
        step only (its copy was queued behind it)."""
        return [row[1 : row[0] + 2] for row in self._host.tolist()]


def verify_inputs(
    tree: TreeBatch,  # [batch, q] trees of one shape
    root_index: torch.Tensor,  # [batch] int64: cache index of each root
    block_tables: torch.Tensor,  # [batch, width] int32
    block_size: int,
    max_seq_len: int,  # bound on root_index + q (grid sizes; a graph's captured bound)
    root_index_cpu: list[int] | None,  # host copy (the reference backend), then exact
) -> StepInputs:
    """Verification inputs built on the device from the roots' cache indices: node ``i``
    of tree ``b`` at cache index ``root_index[b] + i`` with RoPE position ``root_index[b] +
    depth``, every node's logits returned. A uniform step, so a captured verify graph
    replays it."""
    batch, q = tree.token_ids.shape
    device = tree.token_ids.device
    index = root_index[:, None] + torch.arange(q, device=device)  # [batch, q]
    meta = AttentionMetadata(
        slot_mapping=cache_slots(block_tables, index, block_size),
        query_start_loc=torch.arange(0, (batch + 1) * q, q, dtype=torch.int32, device=device),
        seq_lens=(root_index + q).to(torch.int32),
        block_tables=block_tables,
        max_query_len=q,
        max_seq_len=max(root_index_cpu) + q if root_index_cpu is not None else max_seq_len,
        query_lens_cpu=[q] * batch if root_index_cpu is not None else None,
        seq_lens_cpu=[r + q for r in root_index_cpu] if root_index_cpu is not None else None,
    )
    if not tree.is_chain:  # a chain is plain causal attention
        mask = tree.ancestor_mask
        if mask is None:
            mask = ancestor_closure(tree.parents)  # [batch, q, q]
        meta = uniform_tree_mask(mask).attach(meta)
    return StepInputs(
        input_ids=tree.token_ids.flatten(),
        positions=(root_index[:, None] + tree.depths).flatten(),
        meta=meta,
        logits_indices=torch.arange(batch * q, device=device),
        sampled_rows=list(range(batch)),
        logits_counts=[q] * batch,
        is_decode_only=False,
        uniform_q=q,
    )


class SpecPipeline:
    """Launches pipelined speculative steps for one engine (its runner and proposer)."""

    def __init__(self, runner, proposer) -> None:
        self.runner = runner
        self.proposer = proposer
        self.shape = proposer.shape
        self.depth = self.shape.depth
        # Beyond a synchronous step's reservation: the step in flight may emit up to
        # depth + 1 tokens before this one's tree starts.
        self.extra_lookahead = proposer.catch_up_width
        self.num_launches = 0

    @torch.inference_mode()
    def launch(self, requests: list[Request], prev: SpecLaunch | None) -> SpecLaunch:
        """Draft, verify and accept one step for ``requests`` (all decoding, greedy) without
        reading anything back. ``prev``: the step in flight; every request is then one of
        its rows and continues from its device outcome, else all start from the host
        state (``Proposer.pipeline_inputs``)."""
        runner, device = self.runner, self.runner.device
        tables = to_device(
            block_table_array([r.block_ids for r in requests], runner.block_table_width), device
        )
        on_cpu = device.type == "cpu"
        if prev is None:
            inputs = self.proposer.pipeline_inputs(requests)
            inputs.block_tables = tables
        else:
            inputs = self._continue(requests, prev, tables)
            if on_cpu:  # the reference backend loops over host lengths (free off CUDA)
                inputs.start_cpu = inputs.start.tolist()
        root_index = inputs.start  # [batch]: each tree root's cache index
        tree = self.proposer.grow_pipelined(inputs, runner.max_model_len)
        step = verify_inputs(
            tree,
            root_index,
            tables,
            runner.block_size,
            runner.max_model_len,
            inputs.start_cpu if on_cpu else None,
        )
        logits, aux = runner.execute(step)  # [batch * q, vocab], [batch * q, A]
        acceptance = greedy_accept_uniform(
            tree.token_ids, tree.parents, tree.depths, logits, self.depth
        )
        if not tree.is_chain:  # a chain's accepted nodes already sit next to the root
            runner.move_accepted_kv(root_index, acceptance, tables)
        batch, q = tree.token_ids.shape
        path = acceptance.path[:, :, None].expand(-1, -1, aux.shape[1])
        catch_up_aux = aux.view(batch, q, -1).gather(1, path)  # [batch, depth + 1, A]
        packed = torch.cat([acceptance.num_accepted[:, None], acceptance.token_ids], dim=1)
        self.num_launches += 1
        return SpecLaunch(
            requests=list(requests),
            num_draft_tokens=q - 1,
            acceptance=acceptance,
            catch_up_aux=catch_up_aux,
            _host=to_host(packed),
        )

    def _continue(
        self, requests: list[Request], prev: SpecLaunch, tables: torch.Tensor
    ) -> GrowInputs:
        """The head's inputs from the step in flight: its catch-up covers the previous
        root and accepted nodes (from the previous root's index, which the host knows),
        its new root is the bonus token one past them."""
        device = tables.device
        rows = {r.request_id: i for i, r in enumerate(prev.requests)}
        src = [rows[r.request_id] for r in requests]
        acc, aux = prev.acceptance, prev.catch_up_aux
        num_accepted, emitted = acc.num_accepted, acc.token_ids
        if src != list(range(len(prev.requests))):  # some rows finished: keep the others
            index = to_device(np.array(src, dtype=np.int64), device)
            num_accepted = num_accepted.index_select(0, index)
            emitted = emitted.index_select(0, index)
            aux = aux.index_select(0, index)
        # The previous root: the host's num_computed_tokens lags one step behind.
        prev_root = to_device(
            np.array([r.num_computed_tokens for r in requests], dtype=np.int64), device
        )
        return GrowInputs(
            roots=emitted.gather(1, num_accepted[:, None]).squeeze(1),
            start=prev_root + num_accepted + 1,
            block_tables=tables,
            root_state=(emitted, aux, num_accepted, prev_root),
        )
