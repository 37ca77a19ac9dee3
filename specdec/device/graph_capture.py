"""CUDA graph capture: warm a function up, then record one call as a graph.

The engine's step graphs, a proposer's captured proposal and the pipelined speculative
step all capture this way: warm-ups first (lazy allocations, ``torch.compile`` and Triton
autotuning must not happen inside a capture), and graphs of one family share a memory
pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_graph(
    fn: Callable[[], T], pool=None, warmups: int = 2
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` ``warmups`` times (lazy allocations, compilation, autotuning), then
    capture one call as a CUDA graph in memory pool ``pool`` (None: a new one; pass the
    largest graph's ``graph.pool()`` so smaller ones reuse it). Returns the graph and the
    captured call's outputs: static tensors that every replay rewrites."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    torch.cuda.synchronize()
    return graph, outputs
