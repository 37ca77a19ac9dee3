"""Draft-model proposer: a smaller LM with the target's tokenizer drafts a greedy chain.

The draft keeps its own K/V in paged blocks that mirror the target's: the same block ids,
block tables and slots, in separate tensors. So the scheduler's lookahead slots serve
both models, and preemption or finishing frees both at once.

Per request the proposer remembers how many tokens its cache holds. Before drafting it
catches up on the tokens it has not seen (the prompt the first time; after a step, the
tokens the target emitted that differ from what was drafted), then feeds each new draft
token back for the next one. After verification, the draft's entries stay valid up to the
target's computed tokens: accepted drafts are exactly the tokens the draft fed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import SpeculativeConfig
from specdec.engine.request import Request
from specdec.models import load_config, load_model, resolve_model
from specdec.spec.chunk_inputs import Chunk, build_chunk_inputs
from specdec.spec.ngram_proposer import chain_tree
from specdec.spec.proposer import Proposer
from specdec.spec.tree import DraftTree


@dataclass
class _DraftState:
    num_preemptions: int  # the request's count when `computed` was recorded
    computed: int  # tokens whose draft K/V is in the cache


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, config: SpeculativeConfig, *, runner) -> None:
        super().__init__(config)
        if config.model is None:
            raise ValueError("method='draft_model' needs model=<draft model alias/dir/gguf>")
        if config.tree != "chain":
            raise ValueError(
                f"the draft_model proposer drafts chains; got tree={config.tree!r} "
                "(use tree='chain')"
            )
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
        self.model = load_model(
            resolved,
            dtype=runner.dtype,
            device=runner.device,
            attention=runner.attention,
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

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _start(self, request: Request) -> int:
        """First token index the draft cache lacks for ``request``."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0  # new, or preempted: its blocks were freed and recomputed
        return min(state.computed, request.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_draft_tokens: Sequence[int]):
        # 1. Catch up: every token from the cache's end to the root (the last token).
        chunks = []
        for request in requests:
            start = self._start(request)
            chunks.append(Chunk(request, start, request.token_ids(start, request.num_tokens)))
        logits = self._forward(chunks)  # [num_requests, vocab]: logits at each root
        drafts: list[list[int]] = [[] for _ in requests]
        active = list(range(len(requests)))
        next_tokens = logits.argmax(dim=-1).tolist()
        # 2. Feed each draft back for the next one, one token per active request.
        while True:
            for i in active:
                drafts[i].append(next_tokens[active.index(i)])
            active = [i for i in active if len(drafts[i]) < max_draft_tokens[i]]
            if not active:
                break
            chunks = [
                Chunk(requests[i], requests[i].num_tokens + len(drafts[i]) - 1, [drafts[i][-1]])
                for i in active
            ]
            next_tokens = self._forward(chunks).argmax(dim=-1).tolist()
        trees: list[DraftTree | None] = []
        for request, draft in zip(requests, drafts, strict=True):
            # The draft cache now holds the root and every fed draft (all but the last).
            self._states[request.request_id] = _DraftState(
                request.num_preemptions, request.num_tokens + len(draft) - 1
            )
            trees.append(chain_tree(request.token_id(request.num_tokens - 1), draft))
        return trees

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """One varlen draft forward; returns the logits at each chunk's last token."""
        x = build_chunk_inputs(chunks, self.block_size, self.device)
        hidden, _ = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
        return self.model.compute_logits(hidden[x.last_rows])
