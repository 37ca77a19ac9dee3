"""EAGLE-3 proposer: the draft head reads the target's own aux residual streams.

Position convention (EAGLE's): head position ``t`` consumes the pair (token ``x[t+1]``,
``fc(aux[t])``) and predicts ``x[t+2]``; later draft steps consume (draft token, the
previous step's pre-norm output). So with a request whose last committed token (the root)
sits at index ``r`` and whose target-computed tokens are ``0 .. r-1``:

- catch-up: positions ``head_computed .. r-1`` from the aux states the engine handed to
  ``observe`` (all computed tokens); the last one predicts ``x[r+1]``, draft depth 1;
- tree level ``d >= 1`` feeds its depth-``d`` draft nodes at position ``r + d - 1``, each
  with its parent's pre-norm output, attending to its ancestors (``TreeDraftLayout``); a
  chain is the tree with one node per level.

The head's K/V lives in paged blocks mirroring the target's (same block ids and slots, its
own tensors). Draft-step entries are provisional: the next catch-up rewrites those
positions with the target's real aux states, so only positions below the target's
computed tokens count as done. Aux states for prefix-cache hits are never observed; the
head then relies on what the shared blocks hold (drafts may be worse, never wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.config import SpeculativeConfig
from specdec.engine.request import Request
from specdec.models.eagle3_formats import load_eagle3
from specdec.spec.chunk_inputs import Chunk, build_chunk_inputs
from specdec.spec.proposer import Proposer
from specdec.spec.tree import DraftTree, TreeBatch, TreeShape, grow_trees
from specdec.spec.tree_draft import GrowInputs, TreeDraftLayout, TreeGrower


@dataclass
class _HeadState:
    num_preemptions: int
    head_computed: int  # head positions < this hold catch-up (real) entries
    pending: list[torch.Tensor] = field(default_factory=list)  # aux rows from head_computed

    @property
    def num_pending(self) -> int:
        return sum(p.shape[0] for p in self.pending)


class Eagle3Proposer(Proposer):
    name = "eagle3"

    def __init__(self, config: SpeculativeConfig, *, runner) -> None:
        super().__init__(config)
        if config.model is None:
            raise ValueError("method='eagle3' needs model=<EAGLE-3 head directory>")
        self.device = runner.device
        self.block_size = runner.block_size
        self.head = load_eagle3(
            config.model,
            target_config=runner.model_config,
            dtype=runner.dtype,
            device=runner.device,
            attention=runner.attention,
            embed=runner.model.embed,
            max_positions=runner.max_model_len,
        )
        self.aux_layer_ids = tuple(self.head.config.aux_layer_ids)
        c = self.head.config
        shape = (runner.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = (
            torch.zeros(shape, dtype=runner.dtype, device=self.device),
            torch.zeros(shape, dtype=runner.dtype, device=self.device),
        )
        self._states: dict[str, _HeadState] = {}
        self.grower = TreeGrower(self._grow, self.block_size)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def observe(self, request: Request, start: int, aux: torch.Tensor) -> None:
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            # New, or recomputed after preemption (maybe from a prefix-cache hit).
            state = _HeadState(request.num_preemptions, head_computed=start)
            self._states[request.request_id] = state
        expected = state.head_computed + state.num_pending
        if start != expected:
            raise RuntimeError(
                f"request {request.request_id}: aux states start at {start}, expected "
                f"{expected}; the engine must report every computed token once, in order"
            )
        state.pending.append(aux)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_draft_tokens: Sequence[int]):
        rows = [i for i, r in enumerate(requests) if self._catch_up_len(r) > 0]
        trees: list[DraftTree | None] = [None] * len(requests)
        if not rows:
            return trees
        # 1. Catch-up over every observed position; the last row of each predicts depth 1.
        chunks, hidden = [], []
        for i in rows:
            request = requests[i]
            state = self._states[request.request_id]
            start, end = state.head_computed, request.num_computed_tokens
            chunks.append(Chunk(request, start, request.token_ids(start + 1, end + 1)))
            hidden.append(torch.cat(state.pending))  # exactly end - start rows (observe)
            state.head_computed, state.pending = end, []
        out, logits = self._forward(chunks, self.head.fuse(torch.cat(hidden)))
        # 2. Grow the trees, one batch per shape (the configured one; chains near the end).
        groups: dict[TreeShape, list[int]] = {}  # shape -> positions in `rows`
        for j, i in enumerate(rows):
            request = requests[i]
            room = len(request.block_ids) * self.block_size - request.num_computed_tokens
            groups.setdefault(self.shape_for(max_draft_tokens[i], room), []).append(j)
        for shape, members in groups.items():
            picked = torch.tensor(members).to(self.device, non_blocking=True)
            group = [requests[rows[j]] for j in members]
            inputs = GrowInputs.build(
                group,
                [r.num_computed_tokens for r in group],  # the root's cache index
                (out[picked], logits[picked]),
                self.device,
            )
            for j, tree in zip(members, self.grower.grow(shape, inputs).unbind(), strict=True):
                trees[rows[j]] = tree
        return trees

    def capture_graphs(self, max_batch_size: int, block_table_width: int, max_seq_len: int):
        c = self.head.config
        dtype = self.kv_cache[0].dtype
        example = GrowInputs(
            roots=torch.zeros(1, dtype=torch.int64, device=self.device),
            start=torch.zeros(1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            root_state=(
                torch.zeros(1, c.hidden_size, dtype=dtype, device=self.device),
                torch.zeros(1, c.draft_vocab_size, dtype=torch.float32, device=self.device),
            ),
        )
        self.grower.capture(self.shape, max_batch_size, example, block_table_width, max_seq_len)

    def _grow(self, shape: TreeShape, inputs: GrowInputs, max_seq_len: int | None) -> TreeBatch:
        """Draft steps: level ``d`` feeds its nodes at position ``root + d - 1``, each with
        its parent's pre-norm output, laid out from the root's cache index (the target's
        lookahead slots; the next catch-up rewrites them). Root state: the catch-up's last
        pre-norm rows [batch, hidden] and their draft logits [batch, draft_vocab]."""
        layout = TreeDraftLayout(inputs, self.block_size, max_seq_len)
        root_out, root_logits = inputs.root_state
        prev_out = root_out[:, None]  # [batch, 1, hidden]: rows of the previous call

        def step(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int) -> torch.Tensor:
            nonlocal prev_out
            batch, n = tokens.shape
            if depth == 0:
                return self.head.scatter_to_target(root_logits)[:, None]  # [batch, 1, V]
            width = prev_out.shape[2]
            hidden = prev_out.gather(1, parent_rows[:, :, None].expand(batch, n, width))
            x = layout.level(tokens, parent_rows, depth)
            out, logits = self.head(
                x.input_ids, hidden.flatten(0, 1), x.positions, self.kv_cache, x.meta
            )
            prev_out = out.view(batch, n, width)
            return self.head.scatter_to_target(logits).view(batch, n, -1)

        return grow_trees(shape, inputs.roots, step)

    def _catch_up_len(self, request: Request) -> int:
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0
        return request.num_computed_tokens - state.head_computed

    def _forward(
        self, chunks: list[Chunk], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One varlen head forward. Returns the pre-norm output and the draft logits at
        each chunk's last row."""
        x = build_chunk_inputs(chunks, self.block_size, self.device)
        out, logits = self.head(
            x.input_ids, hidden, x.positions, self.kv_cache, x.meta, logits_indices=x.last_rows
        )
        return out[x.last_rows], logits
