"""Draft-model proposer: a smaller LM with the target's tokenizer drafts a chain or a tree
of its top-ranked tokens.

The draft keeps its own K/V in paged blocks that mirror the target's: the same block ids,
block tables and slots, in separate tensors. So the scheduler's lookahead slots serve
both models, and preemption or finishing frees both at once.

Per request the proposer remembers how many tokens its cache holds. Before drafting it
catches up on the tokens it has not seen (the prompt the first time; after a step, the
tokens the target emitted that differ from what was drafted), then grows the tree level by
level, each level one forward over its nodes (``TreeDraftLayout``). After verification, a
fed draft's entry stays valid where the request really holds that token at that index and
the target has computed it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specdec.config import SpeculativeConfig
from specdec.models import load_config, load_model, resolve_model
from specdec.request import Request
from specdec.spec.chunk_inputs import Chunk, build_chunk_inputs
from specdec.spec.proposer import Proposer
from specdec.spec.topk import level_topk_for
from specdec.spec.tree import DraftTree, TreeBatch, grow_trees
from specdec.spec.tree_draft import (
    GrowInputs,
    TreeDraftLayout,
    TreeGrower,
    catch_up_inputs,
    pack_catch_ups,
)
from specdec.tree_shapes import TreeShape


@dataclass
class _DraftState:
    num_preemptions: int  # the request's count when this was recorded
    computed: int  # tokens 0 .. computed-1 have draft K/V in the cache (through the root)
    fed: list[int]  # tokens fed at cache indices computed, computed+1, ... along one path


class DraftModelProposer(Proposer):
    name = "draft_model"
    uses_draft_attention = True

    def __init__(self, config: SpeculativeConfig, *, runner) -> None:
        super().__init__(config, runner=runner)
        if config.model is None:
            raise ValueError("method='draft_model' needs model=<draft model alias/dir/gguf>")
        resolved = resolve_model(config.model)
        draft_config = load_config(resolved)
        target_vocab = runner.model_config.vocab_size
        if draft_config.vocab_size != target_vocab:
            raise ValueError(
                f"draft model {config.model!r} has vocab_size {draft_config.vocab_size} but "
                f"the target has {target_vocab}; a draft model must share the tokenizer"
            )
        self.device = runner.device
        self.block_size = runner.block_size
        self.level_topk = level_topk_for(runner.runtime.triton_kernels)
        self.model = load_model(
            resolved,
            dtype=runner.dtype,
            device=runner.device,
            attention=runner.draft_attention,
            max_positions=runner.max_model_len,
        )
        shape = (
            runner.num_blocks,
            self.block_size,
            draft_config.num_kv_heads,
            draft_config.head_dim,
        )
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
            )
            for _ in range(draft_config.num_layers)
        ]
        self._states: dict[str, _DraftState] = {}
        self.grower = TreeGrower(self._grow)
        self.max_positions = runner.max_model_len

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _start(self, request: Request) -> int:
        """First token index the draft cache lacks for ``request``: past the root, fed
        drafts count only where the request really holds those tokens."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0  # new, or preempted: its blocks were freed and recomputed
        valid = state.computed
        for token in state.fed:
            if valid >= request.num_tokens or request.token_id(valid) != token:
                break
            valid += 1
        return min(valid, request.num_computed_tokens)

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], max_draft_tokens: Sequence[int], step_shape: TreeShape
    ):
        # Fed nodes start right after the root.
        rooms = [len(r.block_ids) * self.block_size - r.num_tokens for r in requests]
        groups = self.group_by_shape(step_shape, range(len(requests)), max_draft_tokens, rooms)
        trees: list[DraftTree | None] = [None] * len(requests)
        for shape, members in groups.items():
            group = [requests[i] for i in members]
            grown = self._propose_group(shape, group)
            # Fed drafts the cache may keep: a chain's nodes 1 .. k-1 sit at consecutive
            # indices after the root. A branching tree's level-1 entry is one of several
            # siblings; only the root counts.
            fed = grown.token_ids[:, 1:-1].tolist() if grown.is_chain else [[]] * len(group)
            for i, request, tree, tokens in zip(members, group, grown.unbind(), fed, strict=True):
                self._states[request.request_id] = _DraftState(
                    request.num_preemptions, request.num_tokens, tokens
                )
                trees[i] = tree
        return trees

    def _propose_group(self, shape: TreeShape, group: list[Request]) -> TreeBatch:
        """Catch up on every token from the cache's end to the root, then grow. Short
        catch-ups (after a verify step) run with the growth as one capturable function
        (``_grow``, right-padded); long ones (the prompt) run a varlen forward first."""
        width = self.catch_up_width
        spans = [(self._start(r), r.num_tokens) for r in group]
        roots_at = [end for _, end in spans]  # fed nodes start right after the root
        if all(
            end - start <= width and len(r.block_ids) * self.block_size >= start + width
            for r, (start, end) in zip(group, spans, strict=True)
        ):
            ids = [r.token_ids(start, end) for r, (start, end) in zip(group, spans, strict=True)]
            inputs = GrowInputs.build(group, roots_at, (), self.device)
            inputs.root_state = pack_catch_ups(spans, ids, width, self.device)
            return self.grower.grow(shape, inputs)
        chunks = [
            Chunk(r, start, r.token_ids(start, end))
            for r, (start, end) in zip(group, spans, strict=True)
        ]
        inputs = GrowInputs.build(group, roots_at, (), self.device)
        return self._grow_tree(shape, inputs, self._forward(chunks), None)

    def capture_graphs(
        self, batch_sizes: dict[TreeShape, list[int]], block_table_width: int, max_seq_len: int
    ) -> Iterator[str]:
        tokens, last, start = pack_catch_ups([(0, 1)], [[0]], self.catch_up_width, self.device)
        return self.grower.capture(
            batch_sizes, (tokens, last, start), block_table_width, max_seq_len
        )

    def _grow(self, shape: TreeShape, inputs: GrowInputs, max_seq_len: int | None) -> TreeBatch:
        """Catch-up and growth, device ops only. Root state: ``pack_catch_ups``' tensors
        (``catch_up_inputs`` says why the padding is harmless)."""
        x = catch_up_inputs(
            inputs, *inputs.root_state, self.block_size, max_seq_len, self.max_positions
        )
        hidden, _ = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
        root_logits = self.model.compute_logits(hidden.index_select(0, x.last_rows))
        return self._grow_tree(shape, inputs, root_logits, max_seq_len)

    def _grow_tree(
        self,
        shape: TreeShape,
        inputs: GrowInputs,
        root_logits: torch.Tensor,  # [batch, vocab]: the logits at each root
        max_seq_len: int | None,
    ) -> TreeBatch:
        """Draft steps: level ``d`` feeds its nodes at position ``root + d``, laid out right
        after the root (the target's lookahead slots)."""
        layout = TreeDraftLayout(inputs, self.block_size, max_seq_len, shape.num_expanded)

        def step(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int) -> torch.Tensor:
            if depth == 0:
                return root_logits[:, None]  # [batch, 1, vocab]
            x = layout.level(tokens, parent_rows, depth)
            hidden, _ = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
            return self.model.compute_logits(hidden).view(*tokens.shape, -1)

        return grow_trees(shape, inputs.roots, step, level_topk=self.level_topk)

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """One varlen draft forward; returns the logits at each chunk's last token."""
        x = build_chunk_inputs(chunks, self.block_size, self.device)
        hidden, _ = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
        return self.model.compute_logits(hidden[x.last_rows])
