"""Host-to-device copies of step inputs through pinned staging buffers.

CUDA synchronises the stream before copying from *pageable* host memory: the host waits
until every kernel launched so far has finished. Under async scheduling that means the
step in flight, so each such copy would turn the overlap back into alternation (and in a
synchronous speculative step, preparing the verify inputs would wait for the draft
growth). A copy from *pinned* memory is queued like a kernel and returns at once.

``to_device`` stages an array in a pinned buffer taken from a ring per dtype and queues
the copy. A buffer is reused only once the copy that last used it has finished (an event
per buffer); with a ring deeper than the copies of two steps that never waits. Off CUDA
the array is wrapped without a copy.

``to_host`` is the way back: a device tensor queued into a pinned buffer of a separate
ring, read with ``HostCopy.tolist()``, which waits for that copy only (not for work
queued after it). Read a copy before ``_RING_DEPTH`` more host copies of its dtype reuse
its buffer.
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

    def _take(self, n: int) -> tuple[int, torch.Tensor, torch.cuda.Event]:
        """The next slot's index, buffer (>= ``n`` elements) and event, once the copy that
        last used the buffer has finished."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        event = self.events[i]
        if event is None:
            event = self.events[i] = torch.cuda.Event()
        else:
            event.synchronize()
        buffer = self.buffers[i]
        if buffer is None or buffer.numel() < n:
            size = max(_MIN_ELEMENTS, 1 << max(n - 1, 0).bit_length())
            # A normal tensor even when the first use runs under inference_mode (an engine
            # step): inference tensors cannot be written outside it, normal ones anywhere.
            with torch.inference_mode(False):
                buffer = torch.empty(size, dtype=self.dtype, pin_memory=True)
            self.buffers[i] = buffer
            self.views[i] = None
        return i, buffer, event

    def copy(
        self, array: np.ndarray, device: torch.device, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        n = array.size
        i, buffer, event = self._take(n)
        view = self.views[i]
        if view is None:
            view = self.views[i] = buffer.numpy()
        view[:n] = array.reshape(-1)
        if out is None:
            out = buffer[:n].to(device, non_blocking=True)
        else:
            out.copy_(buffer[:n], non_blocking=True)
        event.record()
        return out.view(array.shape)

    def copy_to_host(self, tensor: torch.Tensor) -> HostCopy:
        _, buffer, event = self._take(tensor.numel())
        values = buffer[: tensor.numel()].view(tensor.shape)
        values.copy_(tensor, non_blocking=True)
        event.record()
        return HostCopy(values, event)


class HostCopy:
    """A tensor on its way into host memory (``to_host``)."""

    def __init__(self, values: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.values = values  # host tensor; complete once the event has passed
        self.event = event

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()  # this copy only, not what was queued after it
        return self.values.tolist()


_rings: dict[torch.dtype, _PinnedRing] = {}  # host -> device
_host_rings: dict[torch.dtype, _PinnedRing] = {}  # device -> host


def to_device(
    array: np.ndarray, device: torch.device | str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (same dtype and shape), copied without making
    the host wait for the device; on CUDA the caller may reuse ``array`` at once, off
    CUDA the tensor shares its memory (pass a fresh array). ``out``: a contiguous device
    tensor of the same dtype whose first ``array.size`` elements receive the copy (a
    CUDA graph's static input, so no device-side copy follows); the result is their view."""
    device = torch.device(device)
    array = np.ascontiguousarray(array)
    tensor = torch.from_numpy(array)
    if out is not None:
        if out.dtype != tensor.dtype or not out.is_contiguous() or out.numel() < array.size:
            raise ValueError(
                f"out ({out.dtype}, {out.numel()} elements) cannot take a {tensor.dtype} "
                f"array of {array.size}: it must be contiguous, same dtype, large enough"
            )
        out = out[: array.size]
        if out.device.type != "cuda":
            return out.copy_(tensor.reshape(-1)).view(array.shape)
    if device.type != "cuda":
        return tensor.to(device)
    return _ring(_rings, tensor.dtype).copy(array, device, out)


def aligned(n: int, itemsize: int) -> int:
    """``n`` elements of ``itemsize`` bytes rounded up to a multiple of 16 bytes."""
    per = 16 // itemsize
    return -(-n // per) * per


def to_device_packed(
    parts: list[np.ndarray], device: torch.device | str, out: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """``parts`` (one dtype) on ``device`` in one copy (``to_device``, into ``out`` when
    given), each part starting 16 bytes apart; returns one view per part.

    Triton specialises a kernel on whether each pointer argument is 16-byte aligned, so a
    view at an offset that moves with the batch size (seq_lens after ``num_seqs + 1``
    entries) would compile a new variant for some batch sizes, mid-request.
    """
    itemsize = parts[0].itemsize
    sizes = [p.size for p in parts]
    starts = np.cumsum([0] + [aligned(k, itemsize) for k in sizes[:-1]]).tolist()
    packed = np.zeros(starts[-1] + sizes[-1], dtype=parts[0].dtype)
    for start, part in zip(starts, parts, strict=True):
        packed[start : start + part.size] = part.reshape(-1)
    on_device = to_device(packed, device, out)
    return [on_device[a : a + k] for a, k in zip(starts, sizes, strict=True)]


def to_host(tensor: torch.Tensor) -> HostCopy:
    """Queue ``tensor``'s copy into pinned host memory without waiting for it; off CUDA
    a plain copy (``tensor`` may be a buffer the next step overwrites)."""
    if not tensor.is_cuda:
        return HostCopy(tensor.clone(), None)
    return _ring(_host_rings, tensor.dtype).copy_to_host(tensor)


def _ring(rings: dict[torch.dtype, _PinnedRing], dtype: torch.dtype) -> _PinnedRing:
    ring = rings.get(dtype)
    if ring is None:
        ring = rings[dtype] = _PinnedRing(dtype)
    return ring
