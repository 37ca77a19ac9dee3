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
  Seeded requests draw from a stream of their own (``DRAFT_STREAM_SALT``), so their
  drafts do not depend on the batch; the others from torch's default RNG.

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
the trees built from the logits stay eager); steps are synchronous (no pipelined step).
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
from specdec.request import Request
from specdec.sampling.seeded_stream import SeededStream, keys_tensor, row_exponentials
from specdec.spec.aux_rows import AuxRows
from specdec.spec.block_graphs import BlockGraphs
from specdec.spec.proposer import Proposer
from specdec.spec.topk import level_topk_for
from specdec.spec.tree import DraftTree, TreeBatch, grow_trees
from specdec.tree_shapes import ChainShape, TreeShape

# A seeded request's draft draws come from SeededStream(seed ^ this): independent of the
# stream its acceptance and sampling draw from (the same keys would correlate the two).
DRAFT_STREAM_SALT = 0x9E6C63D0676A9A99

MIN_CONTEXT_WIDTH = 64  # context_width's floor


class BlockProposer(Proposer):
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
        self._streams: dict[str, SeededStream] = {}  # seeded requests' draft streams
        self.level_topk = level_topk_for(runner.runtime.triton_kernels)
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
        self._streams.pop(request_id, None)

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
                drafts = self._sampled_chains(
                    roots[index], slot_logits, [group[j] for j in members]
                )
            elif isinstance(grown, ChainShape):
                drafts = self._greedy_chains(roots[index], slot_logits)
            else:
                drafts = self._candidate_trees(grown, roots[index], slot_logits)
            for j, tree in zip(members, drafts.unbind(), strict=True):
                trees[rows[j]] = tree
        return trees

    def catch_up(self, group: Sequence[Request]) -> None:
        """Context K/V of every position each request's target computed since the last
        catch-up (``AuxRows.take``), written at the positions' cache slots."""
        spans, aux = self.rows.take(group)
        kept = [k for k, rows in enumerate(aux) if rows is not None]
        if not kept:
            return
        positions = np.concatenate([np.arange(*spans[k]) for k in kept])
        slots = np.concatenate([self._slots(group[k], np.arange(*spans[k])) for k in kept])
        packed = to_device(np.stack([positions, slots]), self.device)  # one copy
        context = self.drafter.context_kv(torch.cat([aux[k] for k in kept]), packed[0])
        for cache, layer in zip(self.kv_cache, context, strict=True):
            cache.k.index_copy_(0, packed[1], layer.k.to(cache.k.dtype))
            cache.v.index_copy_(0, packed[1], layer.v.to(cache.v.dtype))

    def block_logits(
        self,
        group: Sequence[Request],
        roots: torch.Tensor,  # [b] int64: each request's token at r = num_computed_tokens
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """Each request's block forward over its cached context (positions below its
        root ``r``); slot ``k`` predicts the token at ``r + k``."""
        if self.paged:
            return self._paged_block_logits(group, roots)
        lens = np.array([r.num_computed_tokens for r in group], dtype=np.int64)
        width = context_width(int(lens.max()))
        # [b, width] slots of positions 0 .. r - 1, padded with slot 0 (masked by lens).
        index = np.zeros((len(group), width), dtype=np.int64)
        for b, request in enumerate(group):
            index[b, : lens[b]] = self._slots(request, np.arange(lens[b]))
        block = self.drafter.config.block_size
        positions = lens[:, None] + np.arange(block)  # [b, B]
        packed = to_device(np.concatenate([index, positions, lens[:, None]], axis=1), self.device)
        index_t, positions_t, lens_t = packed.split([width, block, 1], dim=1)
        context = [ContextKV(c.k[index_t], c.v[index_t]) for c in self.kv_cache]  # [b, C, kv, d]
        embeds = self.drafter.embed(self.drafter.block_inputs(roots))  # [b, B, hidden]
        return self.drafter.block_logits(embeds, positions_t, context, lens_t[:, 0])

    def _paged_block_logits(
        self,
        group: Sequence[Request],
        roots: torch.Tensor,  # [b] int64
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """``block_logits`` with each layer's attention reading the context K/V in place
        (``kernels.block_attention``): the requests' block tables, nothing gathered. A
        captured graph of the batch's bucket runs it when there is one."""
        lens = np.array([r.num_computed_tokens for r in group], dtype=np.int64)
        bs = self.block_size
        pages = max(1, -(-int(lens.max()) // bs))
        tables = np.zeros((len(group), pages), dtype=np.int64)  # [b, pages]
        for b, request in enumerate(group):
            used = -(-int(lens[b]) // bs)
            tables[b, :used] = request.block_ids[:used]
        packed = to_device(np.concatenate([tables, lens[:, None]], axis=1), self.device)
        tables_t, lens_t = packed.split([pages, 1], dim=1)
        lens_t = lens_t[:, 0].contiguous()
        graphs = self.graphs
        if graphs is not None and graphs.bucket(len(group)) and pages <= graphs.width:
            return graphs.run(roots, tables_t, lens_t)
        return self._block_forward(roots, tables_t, lens_t)

    def _block_forward(
        self,
        roots: torch.Tensor,  # [b] int64
        tables: torch.Tensor,  # [b, pages] int64: each request's pages
        lens: torch.Tensor,  # [b] int64: context positions 0 .. r - 1
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32
        """The block forward on device tensors only (what ``BlockGraphs`` captures)."""
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

    def _slots(self, request: Request, positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return np.asarray(request.block_ids)[positions // bs] * bs + positions % bs

    def _greedy_chains(
        self,
        roots: torch.Tensor,  # [n] int64
        logits: torch.Tensor,  # [n, depth, draft_vocab]
    ) -> TreeBatch:
        """Each slot's argmax: deterministic candidates."""
        return _chains(roots, self.draft_ids[logits.argmax(dim=-1)])

    def _candidate_trees(
        self,
        shape: TreeShape,
        roots: torch.Tensor,  # [n] int64
        logits: torch.Tensor,  # [n, depth, draft_vocab]
    ) -> TreeBatch:
        """``shape`` grown from the slots' candidates: a depth-``d`` node's children are
        ranked by slot ``d + 1``'s draft log-probabilities, the same for every node of a
        depth (a block's slots do not see the tokens drafted before them)."""

        def slot_scores(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int):
            return logits[:, depth, None, :].expand(-1, tokens.shape[1], -1)  # [n, m, V]

        return grow_trees(
            shape, roots, slot_scores, token_map=self.draft_ids, level_topk=self.level_topk
        )

    def _sampled_chains(
        self,
        roots: torch.Tensor,  # [n] int64
        logits: torch.Tensor,  # [n, depth, draft_vocab]
        group: Sequence[Request],
    ) -> TreeBatch:
        """Slot ``k``'s token drawn from ``q_k`` (softmax of the slot's logits at the
        request's temperature), by an exponential race; ``draft_probs`` rows 1..depth hold
        ``q_k`` over the target's vocabulary (row 0, the root's, is unused)."""
        n, depth, vocab = logits.shape
        streams = [self._stream(r) for r in group]
        temperature = to_device(
            np.array([r.sampling_params.temperature for r in group], dtype=np.float32),
            self.device,
        )
        q = (logits / temperature[:, None, None]).softmax(dim=-1)  # [n, depth, draft_vocab]
        race = torch.empty_like(q).exponential_()  # [n, depth, vocab]
        seeded = [b for b, s in enumerate(streams) if s is not None]
        if seeded:
            keys = keys_tensor([streams[b] for b in seeded], self.device)
            rows = to_device(np.array(seeded, dtype=np.int64), self.device)
            race.index_copy_(0, rows, row_exponentials(keys, depth * vocab).view(-1, depth, vocab))
        drawn = (q / race).argmax(dim=-1)  # [n, depth] draft columns
        chains = _chains(roots, self.draft_ids[drawn])
        probs = q.new_zeros(n, depth + 1, self.drafter.config.vocab_size)
        probs[:, 1:].index_copy_(2, self.draft_ids, q)
        chains.draft_probs, chains.sampled = probs, True
        return chains

    def _stream(self, request: Request) -> SeededStream | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.request_id not in self._streams:
            self._streams[request.request_id] = SeededStream(seed ^ DRAFT_STREAM_SALT)
        return self._streams[request.request_id]


def context_width(longest: int) -> int:
    """The padded context width of a block forward whose longest context is ``longest``
    positions: the next power of two, at least ``MIN_CONTEXT_WIDTH``. The forward's shapes
    then change only when a context doubles, so kernels and plans chosen per shape are
    reused step after step; padding rows are masked and cost at most the real ones."""
    return max(MIN_CONTEXT_WIDTH, 1 << max(longest - 1, 0).bit_length())


def _chains(
    roots: torch.Tensor,  # [n] int64
    tokens: torch.Tensor,  # [n, depth] int64 target ids
) -> TreeBatch:
    """Chains ``root, tokens[b, 0], tokens[b, 1], ...``: node i's parent is node i - 1."""
    n, depth = tokens.shape
    nodes = torch.arange(depth + 1, device=roots.device)
    return TreeBatch(
        token_ids=torch.cat([roots[:, None], tokens], dim=1),
        parents=(nodes - 1).clamp_min(0).expand(n, -1),
        depths=nodes.expand(n, -1),
        is_chain=True,
    )


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
