"""CUDA graphs of a block drafter's forward: one per bucketed batch size.

A block forward (``BlockProposer._block_forward``) takes each drafting request's root
token, block table and context length and returns the draft logits of every slot; its
attention reads the context K/V in place (``kernels.block_attention``), so one graph per
batch size serves every context length: the block tables are captured at the cache's
full width and the kernel stops at each request's length, read on the device.

Padding rows (a batch below its bucket) draft from token 0 with an empty context and
all-null block tables: they read nothing from the cache and their logits are dropped.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

import torch

from specdec.device.graph_capture import capture_graph

BlockForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``forward(roots [b], block_tables [b, width], context_lens [b]) -> logits [b, B - 1, V]``:
device ops only."""


class BlockGraphs:
    """Graphs of ``forward`` for ``batch_sizes``, captured by iterating ``capture()``
    (largest first: the others share its memory pool). ``batch_sizes`` holds the sizes
    captured so far, so a batch never picks a graph that is not there yet. Tests replace
    ``_capture`` and ``_replay`` with eager stand-ins."""

    def __init__(
        self,
        forward: BlockForward,
        batch_sizes: list[int],
        block_table_width: int,
        device: torch.device,
    ) -> None:
        self.planned = sorted(set(batch_sizes))
        self.batch_sizes: list[int] = []  # captured, ascending
        m = self.planned[-1]
        self.roots = torch.zeros(m, dtype=torch.int64, device=device)
        self.tables = torch.zeros(m, block_table_width, dtype=torch.int64, device=device)
        self.lens = torch.zeros(m, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0
        self._forward = forward

    @property
    def width(self) -> int:
        return self.tables.shape[1]

    def capture(self) -> Iterator[int]:
        """Capture one graph per iteration, largest batch size first; yields its size."""
        for bs in reversed(self.planned):
            self.outputs[bs] = self._capture(bs)
            bisect.insort(self.batch_sizes, bs)
            yield bs

    def _capture(self, bs: int) -> torch.Tensor:
        graph, logits = capture_graph(
            lambda: self._forward(self.roots[:bs], self.tables[:bs], self.lens[:bs]), self.pool
        )
        self.pool = graph.pool()
        self.graphs[bs] = graph
        return logits

    def _replay(self, bs: int) -> None:
        self.graphs[bs].replay()

    def bucket(self, batch: int) -> int | None:
        return next((bs for bs in self.batch_sizes if bs >= batch), None)

    def run(
        self,
        roots: torch.Tensor,  # [b] int64
        tables: torch.Tensor,  # [b, pages] int64, pages <= width
        lens: torch.Tensor,  # [b] int64
    ) -> torch.Tensor:  # [b, B - 1, V] float32, a copy
        b, pages = tables.shape
        bs = self.bucket(b)
        if bs is None or pages > self.width:
            raise ValueError(
                f"a block forward of {b} requests over {pages} pages does not fit the "
                f"captured graphs (batch sizes {self.batch_sizes}, {self.width} pages)"
            )
        self.roots[:b].copy_(roots)
        self.tables[:b, :pages].copy_(tables)
        self.tables[:b, pages:].zero_()
        self.lens[:b].copy_(lens)
        if b < bs:
            self.roots[b:bs].zero_()
            self.tables[b:bs].zero_()
            self.lens[b:bs].zero_()
        self._replay(bs)
        self.num_replays += 1
        return self.outputs[bs][:b].clone()  # the next replay overwrites the outputs
