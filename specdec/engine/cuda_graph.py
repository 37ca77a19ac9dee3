"""CUDA graphs for decode steps, one per bucketed batch size.

On the H200 a decode step of a small model is launch-bound (hundreds of small kernels), so
each decode batch replays a captured graph: inputs are copied into static buffers, the
graph runs the whole forward plus the lm_head, and the logits come out of a static buffer.
A batch of ``n`` sequences uses the smallest bucket ``>= n``; the padding rows point at
the null block (slot 0, context length 1) and their logits are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.attention.metadata import AttentionMetadata

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch_size`` (denser where batches are common)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captures ``forward(input_ids, positions, meta) -> logits`` for each bucket.

    ``max_seq_len`` is captured as the model's context limit so that one graph serves every
    context length; the attention kernels stop at each sequence's real length.
    """

    def __init__(
        self,
        forward: ForwardFn,
        batch_sizes: list[int],
        block_table_width: int,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.width = block_table_width
        n = self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, block_table_width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._forward = forward
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def _capture_all(self) -> None:
        # Largest first, so smaller graphs reuse the memory pool the largest one set up.
        for bs in reversed(self.batch_sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            for _ in range(2):  # warm up: compilation, autotuning, lazy allocations
                self._forward(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def bucket(self, batch_size: int) -> int | None:
        for bs in self.batch_sizes:
            if bs >= batch_size:
                return bs
        return None

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [n, vocab] float32 logits
        n = input_ids.shape[0]
        bs = self.bucket(n)
        assert bs is not None, f"batch of {n} exceeds the largest graph ({self.max_batch_size})"
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if n < bs:  # padding rows read and write the null block only
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
