"""Host-to-device copies of step inputs through pinned staging buffers.

CUDA synchronises the stream before copying from *pageable* host memory: the host waits
until every kernel launched so far has finished. Under async scheduling that means the
step in flight, so each such copy would turn the overlap back into alternation (and in a
synchronous speculative step, preparing the verify inputs would wait for the draft
growth). A copy from *pinned* memory is queued like a kernel and returns at once.

``to_device`` stages an array in a pinned buffer taken from a ring per dtype and queues
the copy. A buffer is reused only once the copy that last read it has finished (an event
per buffer); with a ring deeper than the copies of two steps that never waits. Off CUDA
the array is wrapped without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

_RING_DEPTH = 16
_MIN_ELEMENTS = 4096


class _PinnedRing:
    """Pinned buffers of one dtype, used round-robin."""

    def __init__(self, dtype: torch.dtype, depth: int = _RING_DEPTH) -> None:
        self.dtype = dtype
        self.buffers: list[torch.Tensor | None] = [None] * depth
        self.views: list[np.ndarray | None] = [None] * depth
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    def copy(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        event = self.events[i]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer is done
        n = array.size
        buffer, view = self.buffers[i], self.views[i]
        if buffer is None or buffer.numel() < n:
            size = max(_MIN_ELEMENTS, 1 << (n - 1).bit_length())
            buffer = torch.empty(size, dtype=self.dtype, pin_memory=True)
            view = buffer.numpy()
            self.buffers[i], self.views[i] = buffer, view
        assert view is not None
        view[:n] = array.reshape(-1)
        out = buffer[:n].to(device, non_blocking=True)
        if event is None:
            event = self.events[i] = torch.cuda.Event()
        event.record()
        return out.view(array.shape)


_rings: dict[torch.dtype, _PinnedRing] = {}


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (same dtype and shape), copied without making
    the host wait for the device; on CUDA the caller may reuse ``array`` at once, off
    CUDA the tensor shares its memory (pass a fresh array)."""
    device = torch.device(device)
    array = np.ascontiguousarray(array)
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    ring = _rings.get(tensor.dtype)
    if ring is None:
        ring = _rings[tensor.dtype] = _PinnedRing(tensor.dtype)
    return ring.copy(array, device)
