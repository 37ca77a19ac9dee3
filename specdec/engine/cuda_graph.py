"""CUDA graphs for the target's uniform steps, one graph per (tokens per sequence,
bucketed batch size); steps with prefill tokens have theirs in prefill_graphs.py.

On the H200 a step of a small model is launch-bound (hundreds of small kernels), so steps
replay a captured graph wherever one holds them. Uniform steps (``StepGraphs``) build
their inputs in the graph's static buffers (``GraphStaging``: the host-to-device copies
land there, padded on the host, so only the block tables and a tree mask are copied on
the device); the graph runs the whole forward plus the lm_head (and the aux residual
streams a proposer reads), and the outputs come out of static buffers. Two shapes repeat:

- decode steps: every sequence computes ``q = 1`` token;
- verify steps: every sequence computes a draft tree of ``q`` nodes (root included). Their
  graphs always take the tree-mask path; a batch of chains copies in a causal mask.

A batch of ``n`` sequences uses the smallest bucket ``>= n``; padding sequences point at the
null block (slot 0) with ``q`` tokens of context and their outputs are ignored.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from specdec.device.graph_capture import capture_graph
from specdec.device.staging import aligned
from specdec.ops.attention_metadata import AttentionMetadata

ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor | None]
]
"""``forward(input_ids, positions, meta) -> (logits [n, vocab], aux [n, A] or None)``."""


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch_size`` (denser where batches are common)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


def tree_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Coarser buckets for verify steps (each graph holds ``bucket * q`` logits rows)."""
    coarse = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    sizes = [s for s in coarse if s < max_batch_size] + [max_batch_size]
    return sorted(set(sizes))


@dataclass(frozen=True)
class GraphStaging:
    """Where a step that replays graph ``(q, bucket)`` stages its inputs: in the graph's
    own static buffers, so the step's two host-to-device copies land where the graph reads
    and no device-side copy follows. ``build_step_inputs`` writes the layout:

    - ``int64``: input ids, positions, slot mapping, each ``bucket * q`` long (the rows
      past the step's tokens zero: padding sequences compute token 0 into the null
      block's slot 0), then the step's other int64 rows;
    - ``int32``: seq_lens, ``bucket`` long (padding sequences: ``q``), then the rest of
      the packed int32 parts, each starting 16 bytes apart (``staging.to_device_packed``).

    Block tables (and a tree mask) are still copied on the device: the graph reads them
    at the cache's full width, which the host does not send every step.
    """

    q: int
    bucket: int
    int64: torch.Tensor
    int32: torch.Tensor


class _Buffers:
    """Static inputs of every graph with ``q`` tokens per sequence (sized for the largest
    bucket). The token rows of bucket ``bs`` are the first ``3 * bs * q`` of ``int64``
    (ids, positions, slots; the layout of ``GraphStaging``); other inputs are prefixes."""

    def __init__(self, q: int, max_batch: int, width: int, device: torch.device) -> None:
        n = max_batch * q
        self.q, self.max_batch = q, max_batch
        # Token rows (3n), then room for the step's logits rows (<= n), tree rows (<= n)
        # and pending-token rows and sources (<= max_batch each).
        self.int64 = torch.zeros(5 * n + 2 * max_batch, dtype=torch.int64, device=device)
        # seq_lens, query_start_loc and the step's block tables (at its own width).
        size = aligned(max_batch, 4) + aligned(max_batch + 1, 4) + max_batch * width
        self.int32 = torch.zeros(size, dtype=torch.int32, device=device)
        self.seq_lens = self.int32[:max_batch]
        self.seq_lens.fill_(q)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(
            0, (max_batch + 1) * q, q, dtype=torch.int32, device=device
        )
        self.tree_lens = torch.full((max_batch,), q, dtype=torch.int32, device=device)
        self.tree_mask_offsets = torch.arange(max_batch, device=device) * (q * q)
        tril = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        self.causal = tril.repeat(max_batch, 1).flatten()  # [max_batch * q * q]
        self.tree_mask = self.causal.clone()

    def tokens(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bucket ``bs``'s input ids, positions and slot mapping: [bs * q] int64 each."""
        n = bs * self.q
        return self.int64[:n], self.int64[n : 2 * n], self.int64[2 * n : 3 * n]

    def meta(self, bs: int, max_seq_len: int) -> AttentionMetadata:
        q = self.q
        tree = {}
        if q > 1:
            tree = {
                "tree_lens": self.tree_lens[:bs],
                "tree_mask_offsets": self.tree_mask_offsets[:bs],
                "tree_mask": self.tree_mask[: bs * q * q],
                "max_tree_len": q,
            }
        return AttentionMetadata(
            slot_mapping=self.tokens(bs)[2],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=q,
            max_seq_len=max_seq_len,
            **tree,
        )


class GraphSet:
    """Graphs keyed by a shape, captured into one shared memory pool, with their outputs:
    static tensors that every replay of that graph rewrites. Subclasses decide the keys
    and how a step's inputs reach the static buffers; tests replace ``_capture`` and
    ``_replay`` with eager stand-ins."""

    def __init__(self, forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]):
        self._forward = forward
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None

    def _capture(
        self, key: tuple[int, int], args: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Warm up, capture ``forward(*args)`` as graph ``key``; returns its outputs."""
        graph, outputs = capture_graph(lambda: self._forward(*args), self.pool)
        self.pool = graph.pool()
        self.graphs[key] = graph
        return outputs

    def _replay(self, key: tuple[int, int]) -> None:
        self.graphs[key].replay()


class StepGraphs(GraphSet):
    """Captures ``forward`` for uniform steps. ``max_seq_len`` is captured as the model's
    context limit so that one graph serves every context length; the attention kernels stop
    at each sequence's real length."""

    def __init__(
        self,
        forward: ForwardFn,
        block_table_width: int,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        super().__init__(forward)
        self.width = block_table_width
        self.max_seq_len = max_seq_len
        self.device = device
        self._buffers: dict[int, _Buffers] = {}
        self.batch_sizes: dict[int, list[int]] = {}
        self.num_replays: dict[int, int] = {}  # per q

    def capture(self, q: int, batch_sizes: list[int]) -> None:
        """Graphs for steps of ``q`` tokens per sequence at each batch size."""
        for _ in self.captures(q, batch_sizes):
            pass

    def captures(
        self, q: int, batch_sizes: list[int], max_batch_size: int | None = None
    ) -> Iterator[int]:
        """``capture``, one graph per iteration (it yields the batch size captured), sizes
        already captured skipped; a size serves steps (``bucket``) once its graph is
        captured. ``max_batch_size``: the largest size any call for ``q`` captures (default:
        this call's largest), fixed by the first call: every graph of ``q`` reads one set
        of static inputs."""
        sizes = sorted(batch_sizes)
        if q not in self._buffers:
            largest = max(sizes[-1], max_batch_size or 0)
            self._buffers[q] = _Buffers(q, largest, self.width, self.device)
            self.batch_sizes[q] = []
        buffers, captured = self._buffers[q], self.batch_sizes[q]
        if sizes[-1] > buffers.max_batch:
            raise ValueError(
                f"batch size {sizes[-1]} exceeds the {buffers.max_batch} that the graphs of "
                f"{q}-token steps were planned for (max_batch_size of the first call)"
            )
        # Largest first, so smaller graphs reuse the memory pool the largest one set up.
        for bs in reversed(sizes):
            if bs in captured:
                continue
            input_ids, positions, _ = buffers.tokens(bs)
            args = (input_ids, positions, buffers.meta(bs, self.max_seq_len))
            self.outputs[q, bs] = self._capture((q, bs), args)
            bisect.insort(captured, bs)
            yield bs

    def bucket(self, q: int, num_seqs: int) -> int | None:
        for bs in self.batch_sizes.get(q, ()):  # captured sizes, ascending
            if bs >= num_seqs:
                return bs
        return None

    def staging(self, q: int, num_seqs: int) -> GraphStaging | None:
        """Where a step of ``num_seqs`` sequences x ``q`` tokens stages its inputs to replay
        a graph (None: no graph holds it)."""
        bs = self.bucket(q, num_seqs)
        if bs is None:
            return None
        buf = self._buffers[q]
        return GraphStaging(q, bs, buf.int64, buf.int32)

    def run(
        self,
        q: int,
        input_ids: torch.Tensor,  # [num_seqs * q] int64
        positions: torch.Tensor,  # [num_seqs * q] int64
        meta: AttentionMetadata,
        staged: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [num_seqs * q, vocab], aux
        """Replay the graph for the step. ``staged``: the inputs were built into this
        graph's buffers (``staging``; token rows and seq_lens padded on the host), so only
        the block tables and the tree mask are copied here."""
        num_seqs = meta.num_seqs
        bs = self.bucket(q, num_seqs)
        assert bs is not None, f"no graph for {num_seqs} sequences of {q} tokens"
        buf = self._buffers[q]
        n = num_seqs * q
        width = meta.block_tables.shape[1]
        if not staged:
            ids, pos, slots = buf.tokens(bs)
            ids[:n].copy_(input_ids)
            pos[:n].copy_(positions)
            slots[:n].copy_(meta.slot_mapping)
            buf.seq_lens[:num_seqs].copy_(meta.seq_lens)
            if num_seqs < bs:  # padding sequences read and write the null block only
                ids[n:].zero_()
                pos[n:].zero_()
                slots[n:].zero_()
                buf.seq_lens[num_seqs:bs].fill_(q)
        buf.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if num_seqs < bs:
            buf.block_tables[num_seqs:bs].zero_()
        if q > 1:
            mask = meta.tree_mask if meta.tree_mask is not None else buf.causal
            buf.tree_mask[: n * q].copy_(mask[: n * q])
        self._replay((q, bs))
        self.num_replays[q] = self.num_replays.get(q, 0) + 1
        logits, aux = self.outputs[q, bs]
        return logits[:n], aux[:n] if aux is not None else None
