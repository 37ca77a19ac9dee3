"""Pinned staging of host-to-device copies (and ``to_host``, the way back): values,
dtypes and shapes arrive intact, a reused ring buffer never corrupts a copy still in
flight, and (on CUDA) staging does not make the host wait for the stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.device.staging import to_device, to_host


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32, np.bool_])
def test_cpu_values_dtype_and_shape(dtype):
    array = (np.arange(24).reshape(4, 6) % 5).astype(dtype)
    out = to_device(array, "cpu")
    assert out.shape == (4, 6) and out.dtype == torch.from_numpy(array).dtype
    assert np.array_equal(out.numpy(), array)
    assert to_host(out).tolist() == array.tolist()


def test_into_a_given_buffer_and_its_errors():
    """``out=``: the copy lands in the buffer's first elements and the result is their view
    (how a step lands in a CUDA graph's static inputs); a wrong buffer is refused."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffer = torch.full((10,), -1, dtype=torch.int64, device=device)
    got = to_device(np.arange(6, dtype=np.int64).reshape(2, 3), device, out=buffer)
    assert got.shape == (2, 3) and got.data_ptr() == buffer.data_ptr()
    assert buffer.tolist() == [0, 1, 2, 3, 4, 5, -1, -1, -1, -1]
    with pytest.raises(ValueError, match=r"cannot take a torch\.int32 array of 6"):
        to_device(np.arange(6, dtype=np.int32), device, out=buffer)
    with pytest.raises(ValueError, match=r"cannot take a torch\.int64 array of 11"):
        to_device(np.arange(11, dtype=np.int64), device, out=buffer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_do_not_wait_and_survive_ring_reuse():
    stream = torch.cuda.current_stream()
    with torch.inference_mode():  # a ring buffer first used inside an engine step...
        to_host(torch.zeros(9000, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the copies
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1 << 40, size=int(rng.integers(1, 9000))) for _ in range(40)]
    outs = [to_device(a, "cuda") for a in arrays[:8]]
    assert not stream.query()  # still sleeping: staging did not synchronise the stream
    outs += [to_device(a, "cuda") for a in arrays[8:]]  # the ring (16) wraps twice
    torch.cuda.synchronize()
    for a, out in zip(arrays, outs, strict=True):
        assert np.array_equal(out.cpu().numpy(), a)
    # The way back: queued behind a busy stream, each read waits for its own copy only.
    torch.cuda._sleep(200_000_000)
    backs = [to_host(out) for out in outs[:16]]  # ...is written outside one here
    assert not stream.query()
    assert [b.tolist() for b in backs] == [a.tolist() for a in arrays[:16]]
    backs = [to_host(out) for out in outs]  # the ring wraps: the last 16 are intact
    assert [b.tolist() for b in backs[-16:]] == [a.tolist() for a in arrays[-16:]]
