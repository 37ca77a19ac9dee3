"""The synchronous step (``StepMode``): every step can run this way, and it reads its
outcome before returning.

Schedule (with lookahead slots for drafts) → draft (``Proposer.propose``, for decoding
rows inside the speculation bands) → prepare and run the target over every row's new
tokens (a verify step: each tree's nodes, root included) → sample plain rows, accept tree
rows (greedy or sampled acceptance) and move the accepted path's K/V next to its root →
the scheduler counts the computed tokens (``Scheduler.update``: a tree row's advance by
what acceptance kept, other rows' by all of theirs) → the step hooks' cuts of tree rows
(hook_cuts.py) → the proposer observes what the target computed → append, trim and
report.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specdec.device.staging import to_device
from specdec.engine.hook_cuts import cut_rows, tree_signals
from specdec.engine.output_processor import RequestState
from specdec.engine.step_mode import StepMode, StepOutputs
from specdec.engine.step_sampling import decodes_plainly, samples_per_token
from specdec.ops.accept import accepted_path_moves
from specdec.outputs import TokenLogprobs
from specdec.sampling.sampler import SamplingMetadata
from specdec.spec.acceptance import accept_batch, greedy_accept_batch
from specdec.spec.tree import DraftTree, root_only_tree


class SyncStep(StepMode):
    """Plain, speculative and mixed steps, read at once (module docstring)."""

    def can_run(self) -> bool:
        return True

    def step(self, deferring: bool) -> StepOutputs:
        engine = self.engine
        num_running = engine.scheduler.num_running
        sched = engine.scheduler.schedule(engine.lookahead)
        if sched.is_empty:
            return []
        scheduled = sched.scheduled
        observing = engine.runner.aux_cache is not None
        if observing and engine.decodes_plainly_at(len(scheduled)):
            engine.defer_observation(num_running, deferring)
            observing = False
        trees = self._propose(scheduled)
        if trees and engine.uniform_verify:
            self._add_root_only_trees(scheduled, trees)
        for row, tree in trees.items():
            scheduled[row].num_new_tokens = tree.num_nodes
        starts = [s.request.num_computed_tokens for s in scheduled]
        inputs = engine.runner.prepare(scheduled, trees)
        logits, aux = engine.runner.execute(inputs)
        engine.num_steps += 1
        if not inputs.sampled_rows:  # prompt chunks only (a tree row is always sampled)
            engine.scheduler.update(scheduled)
            return []
        # Each sampled row's request state, in sampled-row order.
        states = [
            engine.outputs.states[scheduled[r].request.request_id] for r in inputs.sampled_rows
        ]
        # Row offsets of each sampled request in `logits` (1 row, or its tree's nodes).
        offsets = [0]
        for count in inputs.logits_counts:
            offsets.append(offsets[-1] + count)
        emitted: dict[int, list[int]] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        plain = [i for i, r in enumerate(inputs.sampled_rows) if r not in trees]
        if plain:
            if len(plain) == logits.shape[0]:  # every logits row: a plain step, no gather
                plain_logits = logits
            else:
                rows = torch.tensor([offsets[i] for i in plain], device=logits.device)
                plain_logits = logits[rows]
            tokens, lps = engine.step_sampler.to_host([states[i] for i in plain], plain_logits)
            for j, i in enumerate(plain):
                emitted[i] = [tokens[j]]
                if lps:
                    logprobs[i] = lps[j]
        spec = [i for i, r in enumerate(inputs.sampled_rows) if r in trees]
        accepted: dict[int, list[int]] = {}
        if spec:
            accepted = self._verify(inputs, states, trees, spec, logits, offsets, emitted)
        # Tree rows keep their root and accepted nodes; other rows all they computed.
        rejected = {row: trees[row].num_nodes - 1 - len(nodes) for row, nodes in accepted.items()}
        engine.scheduler.update(scheduled, rejected)
        if spec and engine.step_hooks:
            self._cut(inputs, states, trees, spec, emitted, accepted)
        if observing:
            observe(engine.proposer, scheduled, inputs, starts, accepted, aux)
        now = time.monotonic()
        outputs: StepOutputs = []
        processor = engine.outputs
        for i, row in enumerate(inputs.sampled_rows):
            state = states[i]
            request = state.request
            for token_id in emitted[i]:
                processor.append_token(state, token_id, logprobs.get(i), now)
                if request.is_finished:
                    break
            if scheduled[row].num_lookahead_tokens and not request.is_finished:
                engine.kv_manager.trim(request, request.num_computed_tokens)
            processor.report(state, outputs)
        return outputs

    def _propose(self, scheduled) -> dict[int, DraftTree]:
        """Draft trees for decoding rows that reserved lookahead slots."""
        engine = self.engine
        proposer = engine.proposer
        if proposer is None or engine.decodes_plainly_at(len(scheduled)):
            return {}
        shape = proposer.shape_at(len(scheduled))  # the step's band
        rows, limits = [], []
        for row, s in enumerate(scheduled):
            request = s.request
            if s.num_lookahead_tokens == 0 or decodes_plainly(request):
                continue
            # Never draft deeper than max_tokens allows: a step emits at most depth + 1
            # tokens. With room for the whole shape the proposer grows it, else a chain.
            depth_left = request.max_tokens - request.num_output_tokens - 1
            limit = s.num_lookahead_tokens
            if depth_left < shape.depth:
                limit = min(limit, depth_left)
            if limit > 0:
                rows.append(row)
                limits.append(limit)
        if not rows:
            return {}
        drafts = proposer.propose([scheduled[r].request for r in rows], limits, shape)
        return {r: t for r, t in zip(rows, drafts, strict=True) if t is not None}

    @staticmethod
    def _add_root_only_trees(scheduled, trees: dict[int, DraftTree]) -> None:
        """A root-only tree for every other row that plainly decodes one token (no draft,
        or opted out of speculation); verifying it samples the root's next token exactly
        as plain decoding does. Rows that need per-token logprobs or min_tokens stay
        plain."""
        extra: dict[int, DraftTree] = {}
        for row, s in enumerate(scheduled):
            if row in trees:
                continue
            request = s.request
            if (
                s.num_new_tokens != 1
                or request.num_computed_tokens + 1 != request.num_tokens
                or samples_per_token(request)
            ):
                return  # a prefill chunk or a plain-only row: the step cannot be uniform
            extra[row] = root_only_tree(request.token_id(request.num_tokens - 1))
        trees.update(extra)

    def _verify(
        self, inputs, states: list[RequestState], trees, spec, logits, offsets, emitted
    ) -> dict[int, list[int]]:
        """Acceptance for the tree rows (one ``Acceptance`` for the batch, read in one sync),
        then move the accepted paths' K/V next to their roots (``accepted_path_moves``, as
        the pipelined step does). Returns each tree row's accepted node indices (its
        computed tokens are still the root's cache index: ``step`` updates them after)."""
        engine = self.engine
        spec_states = [states[i] for i in spec]
        tree_list = [trees[inputs.sampled_rows[i]] for i in spec]
        if len(spec) == len(inputs.sampled_rows):  # every sampled row verifies a tree
            tree_logits = logits  # [sum nodes, vocab]
        else:
            rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in spec])
            index = to_device(rows, logits.device)
            tree_logits = logits.index_select(0, index)  # [sum nodes, vocab]
        params = [st.request.sampling_params for st in spec_states]
        if all(p.is_greedy for p in params):
            acceptance = greedy_accept_batch(tree_list, tree_logits)
        else:
            streams = [st.stream for st in spec_states]
            meta = SamplingMetadata.build(params, streams, logits.device)
            acceptance = accept_batch(tree_list, tree_logits, meta, engine.sampler.generator)
        results = acceptance.tolist()  # one host sync
        for i, state, tree, result in zip(spec, spec_states, tree_list, results, strict=True):
            emitted[i] = result.token_ids
            if tree.num_draft_tokens:  # root-only trees are plain decodes, not steps
                engine.spec_stats.record(tree.num_draft_tokens, result.num_accepted)
                state.spec_stats.record(tree.num_draft_tokens, result.num_accepted)
        # Only a path that leaves the chain (node i at depth i) has K/V to move.
        if any(node != depth for r in results for depth, node in enumerate(r.accepted_nodes, 1)):
            slots = self._node_slots(inputs, spec, acceptance.width)
            engine.runner.move_kv(*accepted_path_moves(acceptance.to(slots.device), slots))
        return {
            inputs.sampled_rows[i]: r.accepted_nodes for i, r in zip(spec, results, strict=True)
        }

    @staticmethod
    def _node_slots(inputs, spec: list[int], width: int) -> torch.Tensor:  # [len(spec), width]
        """The cache slots of each tree row's nodes (node i is the row's token i), from the
        step's slot mapping; a tree of fewer than ``width`` nodes is padded with its
        root's slot (``accepted_path_moves``)."""
        q_lens = np.asarray(inputs.meta.query_lens_cpu, dtype=np.int64)
        token_starts = np.cumsum(q_lens) - q_lens
        rows = np.array([inputs.sampled_rows[i] for i in spec], dtype=np.int64)
        start, q = token_starts[rows, None], q_lens[rows, None]
        column = np.arange(width)
        index = np.where(column < q, start + column, start)  # [len(spec), width]
        slot_mapping = inputs.meta.slot_mapping
        return slot_mapping[to_device(index, slot_mapping.device)]

    def _cut(self, inputs, states, trees, spec, emitted, accepted) -> None:
        """The step hooks' cuts of the tree rows (``hook_cuts.cut_rows``), after the
        scheduler counted them: a cut row emits its kept and forced tokens, and rolls
        back its accepted nodes past the kept tokens (``observe`` then reports only kept
        ones) with the computed tokens there (their K/V is stale).

        The forced tokens are emitted like sampled ones: ``step`` appends them one by one
        and stops at max_tokens, the context limit or a stop condition, so a request with
        too little budget left gets the forced tokens that fit and ends there. Their K/V
        is computed next step: the request then has more than one uncomputed token, which
        the scheduler runs as a chunk without drafts, sampled at its last token (the
        proposer observes every token of it and catches up on them before drafting
        again, as after a prefill)."""
        engine = self.engine
        rows = [inputs.sampled_rows[i] for i in spec]
        cuts = cut_rows(
            engine.step_hooks,
            [states[i].request for i in spec],
            [emitted[i] for i in spec],
            [len(accepted[row]) for row in rows],
            lambda js: tree_signals([trees[rows[j]] for j in js]),
        )
        for j, cut in cuts.items():
            i, row = spec[j], rows[j]
            emitted[i] = cut.tokens
            # A cut at the bonus token keeps every accepted node: the bonus and the forced
            # tokens are then all uncomputed, and the next step computes them together.
            engine.scheduler.roll_back(states[i].request, len(accepted[row]) - cut.num_accepted)
            accepted[row] = accepted[row][: cut.num_accepted]


def observe(proposer, scheduled, inputs, starts, accepted, aux: torch.Tensor) -> None:
    """Hand the proposer the aux states of every token the target computed in a step: all
    new tokens of plain rows, the root and accepted nodes of tree rows (``accepted``: each
    tree row's accepted node indices; ``starts``: each row's computed tokens before)."""
    q_lens = inputs.meta.query_lens_cpu
    # One gather for every row: each row's computed tokens, back to back.
    picked: list[int] = []
    counts: list[int] = []
    offset = 0
    for row, q_len in enumerate(q_lens):
        if row in accepted:
            picked += [offset, *(offset + node for node in accepted[row])]
            counts.append(1 + len(accepted[row]))
        else:
            picked += range(offset, offset + q_len)
            counts.append(q_len)
        offset += q_len
    index = to_device(np.array(picked, dtype=np.int64), aux.device)
    parts = aux.index_select(0, index).split(counts)
    for s, start, part in zip(scheduled, starts, parts, strict=True):
        proposer.observe(s.request, start, part)
