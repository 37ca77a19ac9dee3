"""CUDA graph capture: warm a function up, then record one call as a graph.

The engine's step graphs, a proposer's captured proposal and the pipelined speculative
step all capture this way: warm-ups first (lazy allocations, ``torch.compile`` and Triton
autotuning must not happen inside a capture), and graphs of one family share a memory
pool.

Python's cyclic garbage collector is paused while a call is recorded. A sweep that lands
inside a capture frees whatever cycles hold, and a CUDA graph among them (inductor's
max-autotune benchmarks its choices as graphs; an exception's traceback can keep one
alive) is destroyed with a CUDA call the capturing stream does not permit ("operation not
permitted when stream is capturing (function reset)"), which invalidates the capture
(``cudaErrorStreamCaptureInvalidated``). Paused, the sweep runs after the capture.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the collector's state is restored
    after it (a caller that had it off keeps it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graph(
    fn: Callable[[], T], pool=None, warmups: int = 2
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` ``warmups`` times (lazy allocations, compilation, autotuning), then
    capture one call as a CUDA graph in memory pool ``pool`` (None: a new one; pass the
    largest graph's ``graph.pool()`` so smaller ones reuse it), with the cyclic garbage
    collector paused (module docstring). Returns the graph and the captured call's
    outputs: static tensors that every replay rewrites."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    torch.cuda.synchronize()
    return graph, outputs
