"""Block drafter proposer (``method="dflash"``, vLLM's name): one drafter forward drafts a
whole block (``specdec.models.block_drafter``), verified as a chain or as a tree of its
per-slot candidates.

At a step a request's committed tokens are ``x[0 .. r]``; the root ``x[r]`` has no
target K/V yet, and the target's aux states of tokens ``0 .. r-1`` reached the proposer
(``observe``, or ``defer`` to the runner's aux cache; ``AuxRows``). The drafter's context
is its per-layer K/V of positions ``0 .. r-1`` (``context_kv`` of each position's aux
row). The block ``[x[r], MASK x (B-1)]`` at positions ``r .. r+B-1`` attends to that
context and to itself both ways; slot ``k`` predicts ``x[r+k]`` whatever comes between,
so one forward gives every depth's candidates. The step's draft uses the first ``depth``
slots (the band's depth, cut by the request's limit):

- a tree band (dynamic or static): ``grow_trees`` with slot ``d + 1``'s draft
  log-probabilities as every depth-``d`` node's children scores, deterministic candidates
  for every request (a dynamic shape keeps the nodes of highest summed log-probability,
  as EAGLE-2 ranks the head's: here the product of the slots' marginals). Sampled
  requests accept deterministic candidates losslessly (``spec.acceptance``);
- a chain band, greedy requests: each slot's argmax (deterministic candidates);
- a chain band, sampled requests: slot ``k``'s token drawn from ``q_k`` = softmax of the
  slot's draft logits at the request's temperature; the tree carries ``q_k`` as node ``k``'s
  ``draft_probs`` row, so lossless rejection sampling applies. The request's top-k,
  top-p and min-p filter the target's distribution only: filtering ``q_k`` too could
  leave it no token in common with the target's, and no draft would ever be accepted.
  ``q_k`` does not depend on the earlier draft tokens, which is allowed: given the
  accepted prefix, node ``k``'s token is still distributed as ``q_k`` (it was drawn
  independently of the coins and tokens that accepted the prefix).
  Seeded requests draw from a stream of their own, so their drafts do not depend on
  the batch; the others from torch's default RNG (``spec.block_drafts`` builds them all).

Context K/V cache. Each position's context K/V depends only on its aux row and position,
so it is computed once, when the position is first caught up on, and written into paged
blocks mirroring the target's (same block ids and slots, the drafter's own tensors).
Block positions are never cached, so nothing the drafter writes goes stale when drafts
are rejected, and acceptance moves nothing of the drafter's. A preempted request starts
afresh when it is recomputed (``AuxRows``); after a prefix-cache hit the drafter reads
whatever its cache holds for the shared blocks (the EAGLE-3 proposer's rule): the rows
of an earlier request over the same tokens, or stale ones (drafts may be worse, never
wrong).

On the Triton path each layer's attention reads the cached context in place through the
requests' block tables (``kernels.block_attention``); elsewhere the block forward gathers
each request's cached context into a dense tensor padded to a power-of-two width
(``context_width``) for ``BlockDrafter.block_logits``. On the GPU path the Triton forward
replays a CUDA graph per bucketed batch size (``spec.block_graphs``; the catch-up and
the trees built from the logits stay eager).

Pipelined steps (``spec.pipeline``, greedy requests): the catch-up state a launch leaves
on the device (``CatchUpState``: the aux rows of the step's root and accepted nodes, the
root's cache index) is all the next draft needs, since block positions are never cached
and the emitted tokens reach the block only as its root (the bonus token). So
``grow_pipelined`` writes the context K/V of the catch-up rows at their slots, runs the
block forward with context length = the new root's cache index, and builds the chain or
tree from the logits: device ops only, captured in the whole step's CUDA graph on the GPU
path. The catch-up is right-padded to ``catch_up_width`` rows; the padding writes the
context of positions from the new root on, which no block reads before a later catch-up
rewrites them with the target's rows (a block reads its context below its root only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from specdec.config import SpeculativeConfig
from specdec.device.staging import to_device
from specdec.kernels.block_attention import block_attention
from specdec.models.block_drafter import ContextKV
from specdec.models.block_drafter_file import read_block_size
from specdec.models.block_drafter_formats import load_block_drafter, read_block_config
from specdec.models.config import ModelConfig
from specdec.ops.attention_metadata import cache_slots, request_slots
from specdec.request import Request
from specdec.spec.aux_rows import AuxRows
from specdec.spec.block_drafts import SlotDrafts
from specdec.spec.block_graphs import BlockGraphs
from specdec.spec.proposer import PipelinedProposer
from specdec.spec.topk import level_topk_for
from specdec.spec.tree import DraftTree, TreeBatch
from specdec.spec.tree_draft import GrowInputs, padded_catch_up_inputs
from specdec.tree_shapes import ChainShape, TreeShape

MIN_CONTEXT_WIDTH = 64  # context_width's floor


class BlockProposer(PipelinedProposer):
    name = "dflash"

    def __init__(self, config: SpeculativeConfig, *, runner) -> None:
        super().__init__(config, runner=runner)
        block_config = read_block_config(_model_dir(config), runner.model_config)
        self.drafter = load_block_drafter(
            _model_dir(config),
            target_config=runner.model_config,
            dtype=runner.dtype,
            device=runner.device,
            # Block positions reach r + B - 1 for a root r < max_model_len.
            max_positions=runner.max_model_len + block_config.block_size,
        )
        c = self.drafter.config
        self._check_shapes(c.block_size)
        self.drafter.eval().requires_grad_(False)
        target = runner.model
        self.drafter.bind_target(target.embed, target.lm_head.weight if c.full_vocab else None)
        self.aux_layer_ids = tuple(c.aux_layer_ids)
        if runner.aux_layer_ids != self.aux_layer_ids:
            raise ValueError(
                f"the runner collects the aux states of layers {list(runner.aux_layer_ids)} "
                f"but the block drafter reads layers {list(self.aux_layer_ids)}; build the "
                "runner with aux_layer_ids=BlockProposer.aux_layers_of(config, target)"
            )
        self.device = runner.device
        self.block_size = runner.block_size  # the KV cache's, not the drafter's block
        shape = (runner.num_blocks * self.block_size, c.num_kv_heads, c.head_dim)
        # Per drafter layer: context K and V by cache slot, on the target's block tables.
        self.kv_cache = tuple(
            ContextKV(
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
                torch.zeros(shape, dtype=runner.dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        )
        self.rows = AuxRows(runner.aux_cache, self.block_size, self.device)
        # Target id of each draft-vocabulary column.
        self.draft_ids = self.drafter.draft_to_target(
            torch.arange(c.draft_vocab_size, device=self.device)
        )
        self.drafts = SlotDrafts(
            self.draft_ids, c.vocab_size, level_topk_for(runner.runtime.triton_kernels)
        )
        # The block forward reads the cached context through the Triton kernel on the
        # Triton path (paged, no gather); elsewhere a dense gather and SDPA.
        self.paged = runner.runtime.triton_kernels
        self.graphs: BlockGraphs | None = None  # capture_graphs, on the GPU path

    def _check_shapes(self, block: int) -> None:
        if self.max_depth > block - 1:
            raise ValueError(_too_deep(self.max_depth, block))

    @classmethod
    def cannot_draft(cls, config: SpeculativeConfig) -> str | None:
        block = read_block_size(_model_dir(config))
        deepest = max(s.depth for _, s in config.bands)
        return _too_deep(deepest, block) if deepest > block - 1 else None

    @classmethod
    def aux_layers_of(cls, config: SpeculativeConfig, target: ModelConfig) -> tuple[int, ...]:
        return tuple(read_block_config(_model_dir(config), target).aux_layer_ids)

    # ---- the target's aux rows ----------------------------------------------------
    def observe(self, request: Request, start: int, aux: torch.Tensor) -> None:
        self.rows.observe(request, start, aux)

    def defer(self, request: Request) -> None:
        self.rows.defer(request)

    def release(self, request_id: str) -> None:
        self.rows.release(request_id)
        self.drafts.release(request_id)

    # ---- drafting -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], max_draft_tokens: Sequence[int], shape: TreeShape
    ) -> list[DraftTree | None]:
        trees: list[DraftTree | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if self.rows.is_current(r)]
        if not rows:
            return trees
        group = [requests[i] for i in rows]
        self.catch_up(group)
        roots = to_device(
            np.array([r.token_id(r.num_computed_tokens) for r in group], dtype=np.int64),
            self.device,
        )  # [b]: each request's last committed token, at position r
        logits = self.block_logits(group, roots)  # [b, B - 1, draft_vocab]
        # One batch per (shape, sampled chain): drafts of one shape and kind stack. Block
        # positions are never cached, so a shape needs no room beyond the request's limit.
        batches: dict[tuple[TreeShape, bool], list[int]] = {}
        for j, i in enumerate(rows):
            grown = self.shape_for(shape, max_draft_tokens[i], room=shape.num_expanded)
            drawn = isinstance(grown, ChainShape) and not group[j].sampling_params.is_greedy
            batches.setdefault((grown, drawn), []).append(j)
        for (grown, drawn), members in batches.items():
            index = to_device(np.array(members, dtype=np.int64), self.device)
            slot_logits = logits.index_select(0, index)[:, : grown.depth]  # [n, depth, V]
            if drawn:
                drafts = self.drafts.sampled_chains(
                    roots[index], slot_logits, [group[j] for j in members]
                )
            else:
                drafts = self.drafts.deterministic(grown, roots[index], slot_logits)
            for j, tree in zip(members, drafts.unbind(), strict=True):
                trees[rows[j]] = tree
        return trees

    def catch_up(self, group: Sequence[Request]) -> None:
        """Context K/V of every position each request's target computed since the last
        catch-up (``AuxRows.take``), written at the positions' cache slots."""
        spans, aux = self.rows.take(group)
        self._write_context(group, spans, aux)

    def _write_context(
        self,
        group: Sequence[Request],
        spans: Sequence[tuple[int, int]],  # per request: [start, end) cache indices
        aux: Sequence[torch.Tensor | None],  # per request: [end - start, aux width]
    ) -> None:
        """Context K/V of each span's positions from its aux rows (empty spans: none)."""
        kept = [k for k, rows in enumerate(aux) if rows is not None and rows.shape[0]]
        if not kept:
            return
        index = {k: np.arange(*spans[k]) for k in kept}  # each span's cache indices
        positions = np.concatenate(list(index.values()))
        slots = np.concatenate(
            [request_slots(group[k].block_ids, i, self.block_size) for k, i in index.items()]
        )
        packed = to_device(np.stack([positions, slots]), self.device)  # one copy
        self._store_context(torch.cat([aux[k] for k in kept]), packed[0], packed[1])

    def _store_context(
        self,
        aux: torch.Tensor,  # [n, aux width]: the target's aux rows
        positions: torch.Tensor,  # [n] int64: their cache indices
        slots: torch.Tensor,  # [n] int64: their cache slots
    ) -> None:
        """Each row's context K/V, written at its slot (device ops only)."""
        context = self.drafter.context_kv(aux, positions)
        for cache, layer in zip(self.kv_cache, context, strict=True):
            cache.k.index_copy_(0, slots, layer.k.to(cache.k.dtype))
            cache.v.index_copy_(0, slots, layer.v.to(cache.v.dtype))

    def block_logits(
        self,
        group: Sequence[Request],
        roots: torch.Tensor,  # [b] int64: each request's token at r = num_computed_tokens
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """Each request's block forward over its cached context (positions below its
        root ``r``); slot ``k`` predicts the token at ``r + k``."""
        lens = np.array([r.num_computed_tokens for r in group], dtype=np.int64)
        bs = self.block_size
        pages = max(1, -(-int(lens.max()) // bs))
        tables = np.zeros((len(group), pages), dtype=np.int64)  # [b, pages]
        for b, request in enumerate(group):
            used = -(-int(lens[b]) // bs)
            tables[b, :used] = request.block_ids[:used]
        packed = to_device(np.concatenate([tables, lens[:, None]], axis=1), self.device)
        tables_t, lens_t = packed.split([pages, 1], dim=1)
        return self._logits(roots, tables_t, lens_t[:, 0].contiguous(), int(lens.max()))

    def _logits(
        self,
        roots: torch.Tensor,  # [b] int64
        tables: torch.Tensor,  # [b, pages] int: each request's pages
        lens: torch.Tensor,  # [b] int64: context positions 0 .. r - 1
        longest: int,  # a bound on ``lens`` (the dense context's padded width)
        captured: bool = False,  # inside a CUDA graph's capture: run, never replay
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """The block forward, device ops only. On the Triton path each layer's attention
        reads the context K/V in place (``kernels.block_attention``), from a captured
        graph of the batch's bucket when there is one; elsewhere each request's context
        is gathered into a dense tensor ``context_width(longest)`` wide."""
        if not self.paged:
            return self._dense_block_forward(roots, tables, lens, context_width(longest))
        graphs = self.graphs
        if (
            not captured
            and graphs is not None
            and graphs.bucket(roots.shape[0])
            and tables.shape[1] <= graphs.width
        ):
            return graphs.run(roots, tables, lens)
        return self._block_forward(roots, tables, lens)

    def _dense_block_forward(
        self,
        roots: torch.Tensor,  # [b] int64
        tables: torch.Tensor,  # [b, pages] int
        lens: torch.Tensor,  # [b] int64
        width: int,  # the dense context's width, >= every length
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """The block forward over each request's context gathered densely (the CPU path):
        positions past a request's length read slot 0, masked by ``lens``."""
        bs, block = self.block_size, self.drafter.config.block_size
        index = torch.arange(width, device=lens.device)  # [width]
        pages = tables[:, (index // bs).clamp(max=tables.shape[1] - 1)].long()  # [b, width]
        slots = torch.where(index < lens[:, None], pages * bs + index % bs, 0)  # [b, width]
        context = [ContextKV(c.k[slots], c.v[slots]) for c in self.kv_cache]  # [b, C, kv, d]
        positions = lens[:, None] + torch.arange(block, device=lens.device)  # [b, B]
        embeds = self.drafter.embed(self.drafter.block_inputs(roots))  # [b, B, hidden]
        return self.drafter.block_logits(embeds, positions, context, lens)

    def _block_forward(
        self,
        roots: torch.Tensor,  # [b] int64
        tables: torch.Tensor,  # [b, pages] int: each request's pages
        lens: torch.Tensor,  # [b] int64: context positions 0 .. r - 1
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """The block forward through the paged kernel, device ops only (what
        ``BlockGraphs`` captures)."""
        b, block = roots.shape[0], self.drafter.config.block_size
        positions = lens[:, None] + torch.arange(block, device=lens.device)  # [b, B]
        scale = self.drafter.layers[0].self_attn.scale

        def attend(layer: int, q, k, v):  # [b*B, heads | kv_heads, d] -> [b*B, heads, d]
            cache = self.kv_cache[layer]
            return block_attention(
                q, k, v, cache.k, cache.v, tables, lens,
                block_size=block, page_size=self.block_size, scale=scale,
            )  # fmt: skip

        embeds = self.drafter.embed(self.drafter.block_inputs(roots))  # [b, B, hidden]
        hidden = self.drafter.block_hidden(
            embeds.reshape(b * block, -1), positions.reshape(-1), attend
        )
        return self.drafter.compute_logits(hidden.view(b, block, -1)[:, 1:])

    # ---- the pipelined step (spec/pipeline.py) ----------------------------------
    def pipeline_ready(self, request: Request) -> bool:
        """Whether ``request`` can start a pipelined step from the host: it has aux rows
        pending (a catch-up of any length: all but its last ``catch_up_width`` rows are
        written by ``pipeline_inputs``, the rest by the launch)."""
        return self.rows.pending_len(request) > 0

    @torch.inference_mode()
    def pipeline_inputs(self, requests: Sequence[Request]) -> GrowInputs:
        """``grow_pipelined``'s inputs from the host state (``pipeline_ready`` requests;
        the engine reserved their slots): each catch-up's last ``catch_up_width`` rows,
        the context K/V of the rows before them written here."""
        group = list(requests)
        spans, aux = self._take_all_but(group, self.catch_up_width)
        return padded_catch_up_inputs(group, spans, aux, self.catch_up_width, self.device)

    @torch.inference_mode()
    def start_pipelined(self, requests: Sequence[Request]) -> torch.Tensor:
        """Arrivals joining the pipeline (``SpecPipeline.arrive``), right after the prefill
        that ``observe``d each prompt through its last index ``r``: the context K/V of
        positions below ``r``, leaving ``r`` to the first pipelined step's catch-up.
        Returns the aux rows at each ``r`` [n, aux width]; positions below ``r`` count as
        computed, as the engine then counts them until it reads the first token
        (``resume``)."""
        group = list(requests)
        spans, aux = self._take_all_but(group, keep=1)
        for request, (start, _) in zip(group, spans, strict=True):
            self.rows.rewind(request, start)
        return torch.cat(aux)

    def _take_all_but(
        self, group: list[Request], keep: int
    ) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
        """Take each request's catch-up (``AuxRows.take``; never empty here), write the
        context K/V of all but its last ``keep`` rows, and return the rest: their spans
        and aux rows [<= keep, aux width], for the caller to deliver."""
        spans, taken = self.rows.take(group)
        heads, head_rows, tails, tail_rows = [], [], [], []
        for (start, end), rows in zip(spans, taken, strict=True):
            if rows is None:
                raise RuntimeError("a pipelined catch-up was asked for a request with none pending")
            mid = max(start, end - keep)
            heads.append((start, mid))
            head_rows.append(rows[: mid - start])
            tails.append((mid, end))
            tail_rows.append(rows[mid - start :])
        self._write_context(group, heads, head_rows)
        return tails, tail_rows

    def grow_pipelined(
        self, shape: TreeShape, inputs: GrowInputs, max_seq_len: int, captured: bool = False
    ) -> TreeBatch:
        """Catch-up and block draft of ``shape`` (the step's band) from the catch-up state
        (``CatchUpState.fields``), device ops only (module docstring). ``captured``: the
        caller is being captured into a CUDA graph: run the block forward instead of
        replaying its graphs."""
        _, aux, _, start = inputs.root_state  # [batch, width, aux width], [batch]
        width = aux.shape[1]
        index = start[:, None] + torch.arange(width, device=start.device)  # [batch, width]
        slots = cache_slots(inputs.block_tables, index, self.block_size)  # [batch * width]
        # Positions reach start + catch_up_width - 1 < the RoPE table's max_model_len + B.
        self._store_context(aux.flatten(0, 1), index.flatten(), slots)
        host = inputs.start_cpu
        longest = max(host) if host is not None else max_seq_len
        # inputs.start is each tree root's cache index: the context is every position below.
        logits = self._logits(inputs.roots, inputs.block_tables, inputs.start, longest, captured)
        return self.drafts.deterministic(shape, inputs.roots, logits[:, : shape.depth])

    def capture_graphs(
        self, batch_sizes: dict[TreeShape, list[int]], block_table_width: int, max_seq_len: int
    ) -> Iterator[str]:
        """Graphs of the block forward for every band's batch sizes (the forward is the
        same whatever the band's shape: each shape reads the slots it needs), on the
        Triton path; they serve once all are captured."""
        if not self.paged or not batch_sizes:
            return
        sizes = sorted({bs for buckets in batch_sizes.values() for bs in buckets})
        graphs = BlockGraphs(self._block_forward, sizes, block_table_width, self.device)
        for bs in graphs.capture():
            yield f"block drafter forward, batch {bs}"
        self.graphs = graphs


def context_width(longest: int) -> int:
    """The padded context width of a block forward whose longest context is ``longest``
    positions: the next power of two, at least ``MIN_CONTEXT_WIDTH``. The forward's shapes
    then change only when a context doubles, so kernels and plans chosen per shape are
    reused step after step; padding rows are masked and cost at most the real ones."""
    return max(MIN_CONTEXT_WIDTH, 1 << max(longest - 1, 0).bit_length())


def _too_deep(depth: int, block: int) -> str:
    return (
        f"the deepest band drafts {depth} tokens deep, past the drafter's block_size - 1 = "
        f"{block - 1} (one block drafts that many positions); set num_speculative_tokens "
        f"(or a tree's depth) <= {block - 1}"
    )


def _model_dir(config: SpeculativeConfig) -> str:
    if config.model is None:
        raise ValueError(
            "method='dflash' needs model=<block drafter directory> (ours, or vLLM's dflash "
            "layout; specdec train-draft model.drafter=block writes one)"
        )
    return config.model
