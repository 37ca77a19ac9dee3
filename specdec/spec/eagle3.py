"""EAGLE-3 proposer: the draft head reads the target's own aux residual streams.

Position convention (EAGLE's): head position ``t`` consumes the pair (token ``x[t+1]``,
``fuse(aux[t])``) and predicts ``x[t+2]``; later draft steps consume (draft token, the
previous step's output: pre-norm, or post-norm for EAGLE-3.1's ``norm_output``). So with
a request whose last committed token (the root) sits at index ``r`` and whose
target-computed tokens are ``0 .. r-1``:

- catch-up: positions ``done .. r-1`` (``AuxRows``) from the aux states of every computed
  token, which the engine handed to ``observe`` or, for steps that do not speculate,
  ``defer``red to the runner's aux cache; the last one predicts ``x[r+1]``, draft depth 1;
- tree level ``d >= 1`` feeds its depth-``d`` draft nodes at position ``r + d - 1``, each
  with its parent's output, attending to its ancestors (``TreeDraftLayout``); a
  chain is the tree with one node per level.

The head's K/V lives in paged blocks mirroring the target's (same block ids and slots, its
own tensors). Draft-step entries are provisional: the next catch-up rewrites those
positions with the target's real aux states, so only positions below the target's
computed tokens count as done. Aux states for prefix-cache hits are never observed; the
head then relies on what the shared blocks hold (drafts may be worse, never wrong).

A head with SpecExit channels also reads its signals from the catch-up's aux states: each
tree carries (``DraftTree.signals``) their mean over the catch-up rows — the tokens the target
verified in the request's previous step (after a prefill or another long catch-up, its
last ``catch_up_width`` rows) — computed in the same capturable function as the tree.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence

import torch

from specdec.config import SpeculativeConfig
from specdec.models.compiling import compile_region
from specdec.models.config import ModelConfig
from specdec.models.eagle3_formats import load_eagle3, read_eagle3_config
from specdec.models.linear import use_triton_gemm
from specdec.request import Request
from specdec.spec.aux_rows import AuxRows
from specdec.spec.chunk_inputs import Chunk, build_chunk_inputs
from specdec.spec.proposer import PipelinedProposer
from specdec.spec.topk import level_topk_for
from specdec.spec.tree import DraftTree, TreeBatch, grow_trees, tree_plan
from specdec.spec.tree_draft import (
    GrowInputs,
    TreeDraftLayout,
    TreeGrower,
    catch_up_inputs,
    pack_catch_ups,
    padded_catch_up_inputs,
)
from specdec.tree_shapes import TreeShape

logger = logging.getLogger(__name__)


class Eagle3Proposer(PipelinedProposer):
    name = "eagle3"
    uses_draft_attention = True

    def __init__(self, config: SpeculativeConfig, *, runner) -> None:
        super().__init__(config, runner=runner)
        _check_model(config)
        self.device = runner.device
        self.block_size = runner.block_size
        start = time.perf_counter()
        self.head = load_eagle3(
            config.model,
            target_config=runner.model_config,
            dtype=runner.dtype,
            device=runner.device,
            attention=runner.draft_attention,
            embed=runner.model.embed,
            max_positions=runner.max_model_len,
        )
        self.head.eval().requires_grad_(False)  # drafting only; see load_model
        logger.info(
            "loaded the EAGLE-3 head %s (%.0f MiB) in %.1f s",
            config.model,
            sum(p.numel() * p.element_size() for p in self.head.parameters()) / 2**20,
            time.perf_counter() - start,
        )
        use_triton_gemm(self.head, runner.triton_gemm_max_rows)  # as the target's
        self.level_topk = level_topk_for(runner.runtime.triton_kernels)
        self.aux_layer_ids = tuple(self.head.config.aux_layer_ids)
        if runner.aux_layer_ids != self.aux_layer_ids:
            raise ValueError(
                f"the runner collects the aux states of layers {list(runner.aux_layer_ids)} "
                f"but the head reads layers {list(self.aux_layer_ids)}; build the runner "
                "with aux_layer_ids=Eagle3Proposer.aux_layers_of(config, target)"
            )
        # The target's aux rows handed over and not consumed yet, per request.
        self.rows = AuxRows(runner.aux_cache, self.block_size, self.device)
        self.exit_signals = self.head.config.exit_signals
        self.spec_exit_defaults = self.head.config.spec_exit_defaults
        c = self.head.config
        shape = (runner.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        # One paged K/V per head layer, on the target's block tables (same block ids).
        self.kv_cache = tuple(
            (
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        )
        self.grower = TreeGrower(self._grow)
        self._graph_grow = self._grow  # what CUDA graphs capture (capture_graphs)
        self.max_positions = runner.max_model_len
        # The head compiles only where the runner allows (CUDA graphs with
        # EngineConfig.compile not False; in deterministic mode too, the target aside).
        self.compile = runner.compile_draft
        # Target id of each draft-vocabulary column: growth ranks in the draft vocabulary.
        self.draft_ids = self.head.draft_to_target(
            torch.arange(self.head.config.draft_vocab_size, device=self.device)
        )

    @classmethod
    def aux_layers_of(cls, config: SpeculativeConfig, target: ModelConfig) -> tuple[int, ...]:
        _check_model(config)
        return tuple(read_eagle3_config(config.model, target).aux_layer_ids)

    def release(self, request_id: str) -> None:
        self.rows.release(request_id)

    def observe(self, request: Request, start: int, aux: torch.Tensor) -> None:
        self.rows.observe(request, start, aux)

    def defer(self, request: Request) -> None:
        self.rows.defer(request)

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], max_draft_tokens: Sequence[int], step_shape: TreeShape
    ):
        rows = [i for i, r in enumerate(requests) if self.rows.pending_len(r) > 0]
        trees: list[DraftTree | None] = [None] * len(requests)
        # Fed nodes start at the root's cache index.
        rooms = [len(r.block_ids) * self.block_size - r.num_computed_tokens for r in requests]
        groups = self.group_by_shape(step_shape, rows, max_draft_tokens, rooms)
        for shape, members in groups.items():
            grown = self._propose_group(shape, [requests[i] for i in members])
            for i, tree in zip(members, grown.unbind(), strict=True):
                trees[i] = tree
        return trees

    def _propose_group(self, shape: TreeShape, group: list[Request]) -> TreeBatch:
        """Catch up on every observed position, then grow. After a verify step each
        request catches up on at most depth + 1 positions (its accepted drafts and the
        bonus token); such batches run catch-up and growth as one capturable function
        (``_grow``: catch-ups right-padded to that length), replayed from the growth
        graphs where they fit. Longer catch-ups (the first draft after a prefill) run a
        varlen forward over all but their last ``catch_up_width`` positions first (the
        head's K/V there), then the same function over the rest."""
        bs = self.block_size
        spans, aux = self._take_catch_ups(group)
        width = self.catch_up_width
        self._forward_all_but(group, spans, aux, width)
        if all(
            len(r.block_ids) * bs >= start + width
            for r, (start, _) in zip(group, spans, strict=True)
        ):
            inputs = padded_catch_up_inputs(group, spans, aux, width, self.device)
            return self.grower.grow(shape, inputs)
        # Near the cache's end (no room for a padded catch-up): one varlen forward.
        chunks = [
            Chunk(r, start, r.token_ids(start + 1, end + 1))
            for r, (start, end) in zip(group, spans, strict=True)
        ]
        out, logits = self._forward(chunks, self.head.fuse(torch.cat(aux)))
        inputs = GrowInputs.build(group, [end for _, end in spans], (), self.device)
        grown = self._grow_tree(shape, inputs, out, logits, None)
        if self.exit_signals:  # [batch, k]: each request's last `width` catch-up rows
            grown.signals = torch.stack([self.head.exit_signals(a[-width:]).mean(0) for a in aux])
        return grown

    def _forward_all_but(
        self,
        group: list[Request],
        spans: list[tuple[int, int]],
        aux: list[torch.Tensor],
        keep: int,
    ) -> None:
        """The head's K/V over each catch-up span but its last ``keep`` positions (one
        varlen forward over the spans longer than that); ``spans`` and ``aux`` are then
        narrowed, in place, to those last positions."""
        long = [i for i, (start, end) in enumerate(spans) if end - start > keep]
        if not long:
            return
        chunks = []
        for i in long:
            start, end = spans[i]
            chunks.append(Chunk(group[i], start, group[i].token_ids(start + 1, end - keep + 1)))
        self._forward(chunks, self.head.fuse(torch.cat([aux[i][:-keep] for i in long])))
        for i in long:
            spans[i] = (spans[i][1] - keep, spans[i][1])
            aux[i] = aux[i][-keep:]

    def _take_catch_ups(
        self, group: list[Request]
    ) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
        """Each request's catch-up span [done, num_computed_tokens) (never empty
        here) and its aux rows (``AuxRows.take``); the head then counts them as computed
        (the caller runs them)."""
        spans, aux = self.rows.take(group)
        rows = [a for a in aux if a is not None]
        if len(rows) != len(aux):
            raise RuntimeError("an EAGLE-3 catch-up was asked for a request with none pending")
        return spans, rows

    # ---- the pipelined step (spec/pipeline.py) ----------------------------------
    def pipeline_ready(self, request: Request) -> bool:
        """Whether ``request`` can start a pipelined step from the host: it has been
        observed and catches up on 1 .. ``catch_up_width`` positions (a verify step or a
        plain decode came last, not a prefill)."""
        return 0 < self.rows.pending_len(request) <= self.catch_up_width

    def pipeline_inputs(self, requests: Sequence[Request]) -> GrowInputs:
        """``grow_pipelined``'s inputs from the host state (``pipeline_ready`` requests;
        the engine reserved their slots)."""
        group = list(requests)
        spans, aux = self._take_catch_ups(group)
        return padded_catch_up_inputs(group, spans, aux, self.catch_up_width, self.device)

    @torch.inference_mode()
    def start_pipelined(self, requests: Sequence[Request]) -> torch.Tensor:
        """Arrivals joining the pipeline (``SpecPipeline.arrive``), right after the prefill
        that ``observe``d each prompt through its last index ``r`` (``num_computed_tokens``
        is still ``r + 1``): the head's K/V at positions ``done .. r - 1`` (their
        tokens are the prompt's), leaving position ``r`` to the first pipelined step's
        catch-up, whose token (the first output) is still on the device. Returns the aux
        rows at each ``r`` [n, aux width]; the head counts positions below ``r`` as
        computed, as the engine then does until it reads the first token (``resume``)."""
        group = list(requests)
        spans, aux = self._take_catch_ups(group)
        self._forward_all_but(group, spans, aux, keep=1)
        for request, (_, end) in zip(group, spans, strict=True):
            self.rows.rewind(request, end - 1)
        return torch.cat(aux)

    def grow_pipelined(
        self, shape: TreeShape, inputs: GrowInputs, max_seq_len: int, captured: bool = False
    ) -> TreeBatch:
        """Catch-up and growth of ``shape`` (the step's band) from device inputs
        (``_grow``'s root state); replays the captured growth when the batch fits.
        ``captured``: the caller is being captured into a CUDA graph: run what the growth
        graphs capture (the head's compiled regions when configured) instead of replaying
        them."""
        if captured:
            bound = max_seq_len if inputs.start_cpu is None else None  # as TreeGrower's
            return self._graph_grow(shape, inputs, bound)
        return self.grower.grow(shape, inputs, max_seq_len)

    def capture_graphs(
        self, batch_sizes: dict[TreeShape, list[int]], block_table_width: int, max_seq_len: int
    ) -> Iterator[str]:
        width = self.catch_up_width
        tokens, last, start = pack_catch_ups([(0, 1)], [[0]], width, self.device)
        hidden_size = self.head.config.hidden_size
        aux = torch.zeros(1, width, 3 * hidden_size, dtype=self.kv_cache[0][0].dtype)
        state_like = (tokens, aux.to(self.device), last, start)
        if self.config.compile_head and self.compile:
            if self.config.compile_growth:
                # One region from the catch-up state to the finished tree: inductor fuses
                # the index arithmetic between the head's layers (slots, positions,
                # gathers, ranks, the vocabulary map), ~10 launches per level otherwise.
                for shape in batch_sizes:  # shape constants made outside tracing
                    tree_plan(shape, self.device)
                self._graph_grow = compile_region(self._grow, fullgraph=True)
                self.compiles_growth = True
            else:  # the head's layers and logits only
                self.head.compile_regions()
                self._graph_grow = functools.partial(self._grow, compiled=True)
        return self.grower.capture(
            batch_sizes,
            state_like,
            block_table_width,
            max_seq_len,
            grow=self._graph_grow,
        )

    def _grow(
        self,
        shape: TreeShape,
        inputs: GrowInputs,
        max_seq_len: int | None,
        compiled: bool = False,
    ) -> TreeBatch:
        """Catch-up and growth in one go, device ops only (``padded_catch_up_inputs``
        made the root state; ``catch_up_inputs`` says why the padding is harmless).
        ``compiled``: the head's compiled regions (captured graphs only)."""
        tokens, aux, last, start = inputs.root_state
        x = catch_up_inputs(
            inputs, tokens, last, start, self.block_size, max_seq_len, self.max_positions
        )
        hidden = self.head.fuse(aux.flatten(0, 1))  # [batch * width, hidden]
        out, logits = self.head(
            x.input_ids,
            hidden,
            x.positions,
            self.kv_cache,
            x.meta,
            logits_indices=x.last_rows,
            compiled=compiled,
        )
        root_out = out.index_select(0, x.last_rows)  # [batch, hidden]
        grown = self._grow_tree(shape, inputs, root_out, logits, max_seq_len, compiled)
        if self.exit_signals:
            grown.signals = self._mean_exit_signals(aux, last)
        return grown

    def _mean_exit_signals(
        self,
        aux: torch.Tensor,  # [batch, width, 3 * hidden]: right-padded catch-ups
        last: torch.Tensor,  # [batch] int64: each catch-up's last real row
    ) -> torch.Tensor:  # [batch, len(exit_signals)] float32
        """SpecExit signals averaged over each catch-up's real rows (device ops only)."""
        batch, width, _ = aux.shape
        values = self.head.exit_signals(aux.flatten(0, 1)).view(batch, width, -1)
        real = torch.arange(width, device=aux.device)[None, :] <= last[:, None]  # [batch, width]
        return (values * real[:, :, None]).sum(1) / (last + 1)[:, None].float()

    def _grow_tree(
        self,
        shape: TreeShape,
        inputs: GrowInputs,
        root_out: torch.Tensor,  # [batch, hidden]: the catch-up's last pre-norm rows
        root_logits: torch.Tensor,  # [batch, draft_vocab]: their depth-1 predictions
        max_seq_len: int | None,
        compiled: bool = False,
    ) -> TreeBatch:
        """Draft steps: level ``d`` feeds its nodes at position ``root + d - 1``, each with
        its parent's output (``Eagle3Head.forward``'s ``out``), laid out from the root's
        cache index (the target's lookahead slots; the next catch-up rewrites them)."""
        layout = TreeDraftLayout(inputs, self.block_size, max_seq_len, shape.num_expanded)
        prev_out = root_out[:, None]  # [batch, 1, hidden]: rows of the previous call

        def step(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int) -> torch.Tensor:
            nonlocal prev_out
            batch, n = tokens.shape
            if depth == 0:
                return root_logits[:, None]  # [batch, 1, draft_vocab]
            width = prev_out.shape[2]
            hidden = prev_out.gather(1, parent_rows[:, :, None].expand(batch, n, width))
            x = layout.level(tokens, parent_rows, depth)
            out, logits = self.head(
                x.input_ids,
                hidden.flatten(0, 1),
                x.positions,
                self.kv_cache,
                x.meta,
                compiled=compiled,
            )
            prev_out = out.view(batch, n, width)
            return logits.view(batch, n, -1)  # [batch, n, draft_vocab]

        return grow_trees(
            shape, inputs.roots, step, token_map=self.draft_ids, level_topk=self.level_topk
        )

    def _forward(
        self, chunks: list[Chunk], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One varlen head forward. Returns the head's ``out`` and the draft logits at
        each chunk's last row."""
        x = build_chunk_inputs(chunks, self.block_size, self.device)
        out, logits = self.head(
            x.input_ids, hidden, x.positions, self.kv_cache, x.meta, logits_indices=x.last_rows
        )
        return out[x.last_rows], logits


def _check_model(config: SpeculativeConfig) -> None:
    if config.model is None:
        raise ValueError("method='eagle3' needs model=<EAGLE-3 head directory>")
