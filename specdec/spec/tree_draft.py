"""Draft steps over a tree: one proposer forward per tree level, on the proposer's paged
cache, and CUDA graphs of the whole growth.

A model proposer (EAGLE head, draft model) grows its trees level by level
(``grow_trees``). Each call feeds one level's nodes; a node attends to the request's
cached context and to its own ancestors among the nodes fed before it. ``TreeDraftLayout``
lays the fed nodes of a batch of trees out in each request's lookahead slots, level after
level from cache index ``start``, and builds each level's varlen inputs: slots, RoPE
positions (every node of level ``d`` sits at position ``start + d - 1``) and the tree mask
of the forest the fed nodes form. The forest's roots are the level-1 nodes: the tree's
own root is part of the cached context, below ``start``.

Fed entries are scratch: they occupy slots that verification overwrites, and a proposer
never counts them as cached unless it re-validates them. Everything is built on device from
sizes the host knows, so a whole proposal (the catch-up after a verify step, every level,
the reranking, the tree tensors and their ancestor masks) is capturable: ``GrowGraphs``
replays it for the configured shape at bucketed batch sizes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.attention.tree_mask import uniform_tree_mask
from specdec.device.graph_capture import capture_graph
from specdec.device.staging import to_device
from specdec.ops.attention_metadata import AttentionMetadata, cache_slots
from specdec.request import Request
from specdec.spec.chunk_inputs import ChunkInputs
from specdec.spec.tree import TreeBatch
from specdec.tree_shapes import TreeShape


@dataclass
class GrowInputs:
    """What growing a batch of trees needs, all with the batch in front."""

    roots: torch.Tensor  # [batch] int64: each tree's root token
    start: torch.Tensor  # [batch] int64: cache index (= RoPE position) of level-1 nodes
    block_tables: torch.Tensor  # [batch, width] int32
    root_state: tuple[torch.Tensor, ...]  # proposer-specific, e.g. the root's logits
    start_cpu: list[int] | None = None  # host copy (eager runs; the reference backend)
    # [batch, width] int64, optional: the cache slots of indices start .. start + width - 1
    # when the caller has looked them up already (the pipelined step: its verification
    # writes the same slots); a layout within ``width`` nodes reuses them.
    slots: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.roots.shape[0]

    @classmethod
    def build(
        cls,
        requests: Sequence[Request],
        start: Sequence[int],
        root_state: tuple[torch.Tensor, ...],
        device: torch.device,
    ) -> GrowInputs:
        width = max(len(r.block_ids) for r in requests)
        tables = np.zeros((len(requests), width), dtype=np.int32)
        for row, request in enumerate(requests):
            tables[row, : len(request.block_ids)] = request.block_ids
        roots = [r.token_id(r.num_tokens - 1) for r in requests]
        # One packed copy per dtype, staged: the host never waits on the device.
        packed = to_device(np.array([*roots, *start], dtype=np.int64), device)
        b = len(requests)
        return cls(
            roots=packed[:b],
            start=packed[b:],
            block_tables=to_device(tables, device),
            root_state=root_state,
            start_cpu=list(start),
        )


class TreeDraftLayout:
    """Where the fed nodes of a batch of trees (one shape) live in the proposer's cache.

    Request ``b``'s blocks must hold ``start[b] + capacity`` slots: ``capacity`` bounds
    the nodes fed over all levels (a shape's ``num_expanded``). ``max_seq_len`` bounds
    every context length (captured graphs pass the model's limit); None derives it from
    ``start_cpu``.

    A draft level launches a few small kernels on the GPU, where a growth is launch-bound,
    so what does not change from level to level is made once: the slots of every fed
    index (one block-table lookup), one ancestor mask that each level extends by its own
    rows (a level's mask is its top-left block), and the index tensors of each level
    width.
    """

    def __init__(
        self, inputs: GrowInputs, block_size: int, max_seq_len: int | None, capacity: int
    ) -> None:
        if max_seq_len is None and inputs.start_cpu is None:
            raise ValueError("pass max_seq_len, or GrowInputs with start_cpu")
        if capacity < 0:
            raise ValueError(f"capacity={capacity} is negative; pass the shape's num_expanded")
        self.inputs = inputs
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.capacity = capacity
        self.device = inputs.roots.device
        self.num_fed = 0  # nodes fed so far per tree (levels are equally wide across trees)
        self.num_levels = 0
        batch = inputs.batch
        if inputs.slots is not None and inputs.slots.shape[1] >= capacity:
            self._slots = inputs.slots  # [batch, >= capacity]
        else:
            index = inputs.start[:, None] + torch.arange(capacity, device=self.device)
            self._slots = cache_slots(inputs.block_tables, index, block_size).view(batch, -1)
        self._start32 = inputs.start.to(torch.int32)
        # [batch, capacity, capacity] bool: row i marks fed node i and its ancestors among
        # the fed nodes; made at the first level that is not a chain's.
        self._ancestors: torch.Tensor | None = None
        self._by_width: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._level_offset = 0  # first fed index of the last level

    def level(
        self,
        tokens: torch.Tensor,  # [batch, n] int64: the nodes of this level
        parent_rows: torch.Tensor,  # [batch, n] int64: rows of the previous level
        depth: int,  # the nodes' depth in the tree (>= 1)
    ) -> ChunkInputs:
        """Inputs that feed ``tokens`` (``grow_trees``' arguments for depth >= 1)."""
        batch, n = tokens.shape
        if depth != self.num_levels + 1:
            raise ValueError(
                f"levels are fed in order: got depth {depth}, expected {self.num_levels + 1}"
            )
        prev, total = self.num_fed, self.num_fed + n
        if total > self.capacity:
            raise ValueError(
                f"level {depth} feeds nodes {prev}..{total - 1}, past the layout's capacity "
                f"of {self.capacity}; size the layout by the shape's num_expanded"
            )
        # One node per level so far: the fed nodes form a chain, which causal attention
        # over their consecutive slots already restricts to ancestors (no mask to build,
        # and the attention takes its decode path).
        chain = n == 1 and prev == self.num_levels
        query_start_loc, rows = self._width_indices(batch, n)
        host = self.inputs.start_cpu
        seq_lens_cpu = [s + total for s in host] if host is not None else None
        meta = AttentionMetadata(
            # contiguous: a level's column slice of [batch, capacity] reshapes to a
            # strided view when it is one node wide, and kernels index slots densely.
            slot_mapping=self._slots[:, prev:total].reshape(-1).contiguous(),
            query_start_loc=query_start_loc,
            seq_lens=self._start32 + total,
            block_tables=self.inputs.block_tables,
            max_query_len=n,
            max_seq_len=self.max_seq_len if seq_lens_cpu is None else max(seq_lens_cpu),
            query_lens_cpu=[n] * batch if host is not None else None,
            seq_lens_cpu=seq_lens_cpu,
        )
        if not chain:
            meta = uniform_tree_mask(self._grow_mask(parent_rows, prev, total, depth)).attach(meta)
        self._level_offset, self.num_fed = prev, total
        self.num_levels += 1
        return ChunkInputs(
            input_ids=tokens.flatten(),
            positions=(self.inputs.start + (depth - 1))[:, None].expand(batch, n).reshape(-1),
            meta=meta,
            last_rows=rows,
        )

    def _width_indices(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc [batch + 1] int32, rows [batch * n]) of a level ``n`` wide."""
        if n not in self._by_width:
            device = self.device
            self._by_width[n] = (
                torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device),
                torch.arange(batch * n, device=device),
            )
        return self._by_width[n]

    def _grow_mask(
        self, parent_rows: torch.Tensor, prev: int, total: int, depth: int
    ) -> torch.Tensor:  # [batch, total, total] bool, contiguous
        """Extend the ancestor mask by the rows of nodes ``prev .. total``: each sees
        itself and, below level 1, its parent's row (the parent's ancestors)."""
        batch = parent_rows.shape[0]
        if self._ancestors is None:
            # Every node sees itself; the chain fed before this first tree level (nodes
            # 0 .. prev) sees its own prefix.
            device, c = self.device, self.capacity
            eye = torch.eye(c, dtype=torch.bool, device=device)
            self._ancestors = eye.expand(batch, c, c).clone()
            if prev:
                chain = torch.ones(prev, prev, dtype=torch.bool, device=device).tril()
                self._ancestors[:, :prev, :prev] = chain
        anc = self._ancestors
        if depth > 1:
            rows = self._level_offset + parent_rows  # [batch, n]
            anc[:, prev:total, :prev] = anc[:, :prev, :prev].gather(
                1, rows[:, :, None].expand(batch, total - prev, prev)
            )
        return anc[:, :total, :total].contiguous()


def catch_up_inputs(
    inputs: GrowInputs,
    tokens: torch.Tensor,  # [batch, width] int64: each catch-up, right-padded
    last: torch.Tensor,  # [batch] int64: each request's last real row
    start: torch.Tensor,  # [batch] int64: cache index (= position) of the first row
    block_size: int,
    max_seq_len: int | None,  # graph bound; None: derived from ``inputs.start_cpu``
    max_positions: int,  # the RoPE table's length
) -> ChunkInputs:
    """Uniform varlen inputs for catch-ups right-padded to ``width`` rows: causal, so the
    padding after a request's real rows never reaches them; its K/V lands in the fed-node
    slots that follow (levels overwrite them or never read them). ``last_rows`` are the
    flat rows of each request's last real token."""
    batch, width = tokens.shape
    device = tokens.device
    index = start[:, None] + torch.arange(width, device=device)  # [batch, width]
    if max_seq_len is None:
        assert inputs.start_cpu is not None
        max_seq_len = max(inputs.start_cpu) + width  # a catch-up starts by the root
    meta = AttentionMetadata(
        slot_mapping=cache_slots(inputs.block_tables, index, block_size),
        query_start_loc=torch.arange(
            0, (batch + 1) * width, width, dtype=torch.int32, device=device
        ),
        seq_lens=(start + width).to(torch.int32),
        block_tables=inputs.block_tables,
        max_query_len=width,
        max_seq_len=max_seq_len,
    )
    return ChunkInputs(
        input_ids=tokens.flatten(),
        positions=index.clamp(max=max_positions - 1).flatten(),  # padding may pass the end
        meta=meta,
        last_rows=torch.arange(batch, device=device) * width + last,
    )


def pack_catch_ups(
    spans: Sequence[tuple[int, int]],  # per request: [start, end) catch-up token indices
    token_ids: Sequence[list[int]],  # per request: its end - start catch-up tokens
    width: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [batch, width] right-padded with 0, last real row [batch], start [batch])
    in one host-to-device copy."""
    flat: list[int] = []
    for ids in token_ids:
        flat += ids + [0] * (width - len(ids))
    b = len(spans)
    packed = to_device(
        np.array(
            [*flat, *(end - start - 1 for start, end in spans), *(s for s, _ in spans)],
            dtype=np.int64,
        ),
        device,
    )
    return packed[: b * width].view(b, width), packed[b * width : -b], packed[-b:]


def padded_catch_up_inputs(
    group: Sequence[Request],
    spans: Sequence[tuple[int, int]],  # per request: [start, end) catch-up cache indices
    aux: Sequence[torch.Tensor],  # per request: [end - start, aux width] aux rows
    width: int,  # the padded catch-up length (a proposer's ``catch_up_width``)
    device: torch.device,
) -> GrowInputs:
    """A proposer's catch-up growth inputs from the host state, the pipelined step's
    ``CatchUpState`` layout: ``root_state`` = (token ids [batch, width], aux rows [batch,
    width, aux width], each request's last real row [batch], catch-up start [batch]),
    right-padded with token 0 and zero aux rows; each span ends at the request's root.
    Catch-up token ``j`` is the token after cache index ``start + j`` (EAGLE's pairing)."""
    ids = [r.token_ids(start + 1, end + 1) for r, (start, end) in zip(group, spans, strict=True)]
    tokens, last, start = pack_catch_ups(spans, ids, width, device)
    # Aux rows land at row b * width + j of a zero-padded [batch * width, aux width] block.
    rows = [b * width + j for b, (s, e) in enumerate(spans) for j in range(e - s)]
    index = to_device(np.array(rows, dtype=np.int64), device)
    flat = torch.cat(list(aux))  # [sum of catch-up lengths, aux width]
    padded = flat.new_zeros(len(group) * width, flat.shape[1]).index_copy_(0, index, flat)
    inputs = GrowInputs.build(group, [end for _, end in spans], (), device)
    inputs.root_state = (tokens, padded.view(len(group), width, -1), last, start)
    return inputs


GrowFn = Callable[[TreeShape, GrowInputs, int | None], TreeBatch]
"""``grow(shape, inputs, max_seq_len) -> TreeBatch``: a proposer's tree growth, device ops
only (``max_seq_len`` as for ``TreeDraftLayout``)."""


class GrowGraphs:
    """CUDA graphs of ``grow`` for one shape, one per bucketed batch size, captured by
    iterating ``capture()`` (largest first: the others reuse its memory pool).
    ``batch_sizes`` holds the sizes captured so far, so a batch never picks a graph that
    is not there yet.

    Padding rows grow trees below token 0 from cache index 0 through all-null block
    tables: they write the null block only, and their trees are dropped.
    """

    def __init__(
        self,
        grow: GrowFn,
        shape: TreeShape,
        batch_sizes: list[int],  # the buckets (tree_graph_batch_sizes, or some of them)
        state_like: tuple[torch.Tensor, ...],  # root state rows: dtypes and trailing sizes
        block_table_width: int,
        max_seq_len: int,
        pool=None,  # a memory pool to share (another shape's graphs)
    ) -> None:
        self.shape = shape
        self.planned = sorted(batch_sizes)
        self.batch_sizes: list[int] = []  # captured, ascending
        device = state_like[0].device
        m = self.planned[-1]
        self.static = GrowInputs(
            roots=torch.zeros(m, dtype=torch.int64, device=device),
            start=torch.zeros(m, dtype=torch.int64, device=device),
            block_tables=torch.zeros(m, block_table_width, dtype=torch.int32, device=device),
            root_state=tuple(
                torch.zeros(m, *t.shape[1:], dtype=t.dtype, device=device) for t in state_like
            ),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, TreeBatch] = {}
        self.num_replays = 0
        self.pool = pool
        self._grow = grow
        self.max_seq_len = max_seq_len

    def capture(self) -> Iterator[int]:
        """Capture one graph per iteration, largest batch size first; yields its size."""
        for bs in reversed(self.planned):
            self.outputs[bs] = self._capture(bs, self._prefix(bs))
            bisect.insort(self.batch_sizes, bs)
            yield bs

    def _capture(self, bs: int, inputs: GrowInputs) -> TreeBatch:
        """Warm up (lazy allocations, autotuning, the shape's indices), capture the growth
        of ``inputs`` as graph ``bs``; returns its outputs."""
        graph, outputs = capture_graph(
            lambda: self._grow(self.shape, inputs, self.max_seq_len), self.pool
        )
        self.pool = graph.pool()
        self.graphs[bs] = graph
        return outputs

    def _replay(self, bs: int) -> None:
        self.graphs[bs].replay()

    def _prefix(self, bs: int) -> GrowInputs:
        s = self.static
        return GrowInputs(
            s.roots[:bs], s.start[:bs], s.block_tables[:bs], tuple(t[:bs] for t in s.root_state)
        )

    def bucket(self, batch: int) -> int | None:
        return next((bs for bs in self.batch_sizes if bs >= batch), None)

    def run(self, inputs: GrowInputs) -> TreeBatch:
        b = inputs.batch
        bs = self.bucket(b)
        assert bs is not None, f"batch {b} exceeds the largest graph ({self.batch_sizes[-1]})"
        s = self.static
        width = inputs.block_tables.shape[1]
        s.roots[:b].copy_(inputs.roots)
        s.start[:b].copy_(inputs.start)
        s.block_tables[:b, :width].copy_(inputs.block_tables)
        s.block_tables[:b, width:].zero_()
        for dst, src in zip(s.root_state, inputs.root_state, strict=True):
            dst[:b].copy_(src)
        if b < bs:
            s.roots[b:bs].zero_()
            s.start[b:bs].zero_()
            s.block_tables[b:bs].zero_()
            for t in s.root_state:
                t[b:bs].zero_()
        self._replay(bs)
        self.num_replays += 1
        out = self.outputs[bs]
        # Copies: the next replay overwrites the graph's outputs.
        return TreeBatch(
            token_ids=out.token_ids[:b].clone(),
            parents=out.parents[:b].clone(),
            depths=out.depths[:b].clone(),
            is_chain=out.is_chain,
            ancestor_mask=out.ancestor_mask[:b].clone() if out.ancestor_mask is not None else None,
            signals=out.signals[:b].clone() if out.signals is not None else None,
        )


class TreeGrower:
    """Grows trees for a proposer: replays the ``GrowGraphs`` of the batch's shape when
    they exist and the batch fits, else runs ``grow`` eagerly."""

    def __init__(self, grow: GrowFn) -> None:
        self._grow = grow
        self.graphs: dict[TreeShape, GrowGraphs] = {}

    def capture(
        self,
        batch_sizes: dict[TreeShape, list[int]],  # each shape's buckets
        state_like: tuple[torch.Tensor, ...],
        block_table_width: int,
        max_seq_len: int,
        grow: GrowFn | None = None,
    ) -> Iterator[str]:
        """Graphs of each shape for its batch sizes, in one memory pool, one per
        iteration (each yields what it captured). ``grow``: the function the graphs
        capture, when it differs from the eager one (e.g. compiled regions, which only
        fixed graph shapes should run). A shape's graphs serve ``grow`` once all of them
        are captured."""
        pool = None
        for shape, sizes in batch_sizes.items():
            graphs = GrowGraphs(
                grow or self._grow,
                shape,
                sizes,
                state_like,
                block_table_width,
                max_seq_len,
                pool,
            )
            for bs in graphs.capture():
                yield f"growth: depth {shape.depth}, {shape.max_draft_tokens} drafts, batch {bs}"
            self.graphs[shape] = graphs
            pool = graphs.pool

    @property
    def num_replays(self) -> int:
        return sum(g.num_replays for g in self.graphs.values())

    def grow(
        self, shape: TreeShape, inputs: GrowInputs, max_seq_len: int | None = None
    ) -> TreeBatch:
        """``max_seq_len``: a bound on context lengths for an eager growth whose inputs
        have no host copy of ``start`` (None: derived from ``inputs.start_cpu``)."""
        graphs = self.graphs.get(shape)
        if graphs is not None and graphs.bucket(inputs.batch):
            return graphs.run(inputs)
        return self._grow(shape, inputs, max_seq_len if inputs.start_cpu is None else None)
