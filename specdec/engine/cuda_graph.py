"""CUDA graphs for uniform steps, one per (tokens per sequence, bucketed batch size).

On the H200 a step of a small model is launch-bound (hundreds of small kernels), so steps
whose shape repeats replay a captured graph: inputs are copied into static buffers, the
graph runs the whole forward plus the lm_head (and the aux residual streams a proposer
reads), and the outputs come out of static buffers. Two shapes repeat:

- decode steps: every sequence computes ``q = 1`` token;
- verify steps: every sequence computes a draft tree of ``q`` nodes (root included). Their
  graphs always take the tree-mask path; a batch of chains copies in a causal mask.

A batch of ``n`` sequences uses the smallest bucket ``>= n``; padding sequences point at the
null block (slot 0) with ``q`` tokens of context and their outputs are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.attention.metadata import AttentionMetadata

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


class _Buffers:
    """Static inputs of every graph with ``q`` tokens per sequence (sized for the largest
    bucket); graphs of smaller buckets use prefixes."""

    def __init__(self, q: int, max_batch: int, width: int, device: torch.device) -> None:
        n = max_batch * q
        self.q = q
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((max_batch,), q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(
            0, (max_batch + 1) * q, q, dtype=torch.int32, device=device
        )
        self.tree_lens = torch.full((max_batch,), q, dtype=torch.int32, device=device)
        self.tree_mask_offsets = torch.arange(max_batch, device=device) * (q * q)
        tril = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        self.causal = tril.repeat(max_batch, 1).flatten()  # [max_batch * q * q]
        self.tree_mask = self.causal.clone()

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
            slot_mapping=self.slot_mapping[: bs * q],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=q,
            max_seq_len=max_seq_len,
            **tree,
        )


class StepGraphs:
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
        self.width = block_table_width
        self.max_seq_len = max_seq_len
        self.device = device
        self._forward = forward
        self._buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.batch_sizes: dict[int, list[int]] = {}
        self.num_replays: dict[int, int] = {}  # per q
        self.pool = None

    def capture(self, q: int, batch_sizes: list[int]) -> None:
        """Graphs for steps of ``q`` tokens per sequence at each batch size."""
        sizes = sorted(batch_sizes)
        buffers = _Buffers(q, sizes[-1], self.width, self.device)
        self._buffers[q] = buffers
        self.batch_sizes[q] = sizes
        # Largest first, so smaller graphs reuse the memory pool the largest one set up.
        for bs in reversed(sizes):
            args = (
                buffers.input_ids[: bs * q],
                buffers.positions[: bs * q],
                buffers.meta(bs, self.max_seq_len),
            )
            self.outputs[q, bs] = self._capture((q, bs), args)

    def _capture(
        self, key: tuple[int, int], args: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Warm up, capture ``forward(*args)`` as graph ``key``; returns its outputs."""
        for _ in range(2):  # warm up: compilation, autotuning, lazy allocations
            self._forward(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._forward(*args)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        torch.cuda.synchronize()
        return outputs

    def _replay(self, key: tuple[int, int]) -> None:
        self.graphs[key].replay()

    def bucket(self, q: int, num_seqs: int) -> int | None:
        for bs in self.batch_sizes.get(q, ()):  # captured sizes, ascending
            if bs >= num_seqs:
                return bs
        return None

    def run(
        self,
        q: int,
        input_ids: torch.Tensor,  # [num_seqs * q] int64
        positions: torch.Tensor,  # [num_seqs * q] int64
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [num_seqs * q, vocab], aux
        num_seqs = meta.num_seqs
        bs = self.bucket(q, num_seqs)
        assert bs is not None, f"no graph for {num_seqs} sequences of {q} tokens"
        buf = self._buffers[q]
        n = num_seqs * q
        width = meta.block_tables.shape[1]
        buf.input_ids[:n].copy_(input_ids)
        buf.positions[:n].copy_(positions)
        buf.slot_mapping[:n].copy_(meta.slot_mapping)
        buf.seq_lens[:num_seqs].copy_(meta.seq_lens)
        buf.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if q > 1:
            mask = meta.tree_mask if meta.tree_mask is not None else buf.causal
            buf.tree_mask[: n * q].copy_(mask[: n * q])
        if num_seqs < bs:  # padding sequences read and write the null block only
            buf.input_ids[n : bs * q].zero_()
            buf.positions[n : bs * q].zero_()
            buf.slot_mapping[n : bs * q].zero_()
            buf.seq_lens[num_seqs:bs].fill_(q)
            buf.block_tables[num_seqs:bs].zero_()
        self._replay((q, bs))
        self.num_replays[q] = self.num_replays.get(q, 0) + 1
        logits, aux = self.outputs[q, bs]
        return logits[:n], aux[:n] if aux is not None else None
