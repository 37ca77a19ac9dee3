"""Per-request randomness for seeded requests: a counter-based stream.

A seeded request must produce the same tokens whatever else runs in its batch. Giving
each request its own ``torch.Generator`` does that, but costs one kernel launch per row
and step (a batch of 256 seeded rows spent ~3.6 ms of host time per step on launches).
Here a request's randomness is instead a pure function of (seed, draw number, element):

- the host draws one 62-bit *key* per use (``SeededStream.next_key``: splitmix64 of the
  seed and a counter, exact in Python integers), and
- the device turns a whole batch's keys into uniforms with one hash per element
  (``uniforms``), a handful of elementwise ops for every row together.

The hash is two rounds of the ``lowbias32`` integer mixer over the element index, keyed
by the key's two halves. For a fixed key it is a bijection of 32-bit indices (xor and
the mixer are), so a draw's elements never collide. Multiplications use each constant's
signed 32-bit residue, so every intermediate fits int64 exactly: CPU and GPU give the same
bits.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from specdec.device.staging import to_device

logger = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# 23 random bits -> (k + 0.5) / 2**23: exact in float32, strictly inside (0, 1).
_UNIFORM_BITS = 23


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SeededStream:
    """The random stream of one seeded request. Create it once when the request arrives
    and pass the same object every step: its draw counter is the stream's state, so the
    request's k-th use of randomness always gets the same key."""

    __slots__ = ("base", "draws", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.base = _splitmix64(seed & _MASK64)  # the seed's half of every key
        self.draws = 0

    def next_key(self) -> int:
        """A 62-bit key (fits int64) for the next draw; advances the stream."""
        key = _splitmix64(self.base ^ self.draws) >> 2
        self.draws += 1
        return key

    def __repr__(self) -> str:
        return f"SeededStream(seed={self.seed}, draws={self.draws})"


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for 0 <= x < 2**32, without int64 overflow: c is replaced by its
    residue in [-2**31, 2**31) (same product mod 2**32), so |x * c| < 2**63."""
    signed = c - (1 << 32) if c >= 1 << 31 else c
    return (x * signed) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a bijection of [0, 2**32) with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(
    keys: torch.Tensor,  # [...] int64: a key per element (broadcast against index)
    index: torch.Tensor,  # [...] int64 in [0, 2**32): the element's index within its draw
) -> torch.Tensor:  # broadcast shape, float32 in (0, 1)
    """U(0, 1) for element ``index`` of the draw with key ``keys`` (pure function)."""
    x = _mix32((index & _MASK32) ^ (keys & _MASK32))
    x = _mix32(x ^ ((keys >> 32) & _MASK32))
    return ((x >> (32 - _UNIFORM_BITS)).float() + 0.5) * (2.0**-_UNIFORM_BITS)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:  # uint64, any shape
    """``_splitmix64`` elementwise: uint64 arithmetic wraps modulo 2**64 exactly as the
    masked Python integers do, so every element gets the same bits."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keys_tensor(streams: list[SeededStream], device: torch.device | str) -> torch.Tensor:
    """The next key of each stream, as one [len(streams)] int64 tensor (one staged copy,
    like the engine's other step inputs: the host does not wait for the device). Equal to
    ``[s.next_key() for s in streams]``, a stream listed twice included (its draws are
    numbered in list order), with the hashing done for the whole batch in numpy."""
    bases: list[int] = []
    draws: list[int] = []
    for s in streams:
        bases.append(s.base)
        draws.append(s.draws)
        s.draws += 1
    mixed = _splitmix64_array(np.array(bases, np.uint64) ^ np.array(draws, np.uint64))
    return to_device((mixed >> np.uint64(2)).astype(np.int64), device)  # 62-bit keys


_fused_uniforms = None  # torch.compile(uniforms) once a CUDA draw needs it; False: failed


def _uniforms_on_cuda(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``uniforms`` as one fused kernel. Eagerly it is ~26 elementwise int64 kernels, each
    over the whole [rows, vocab] block (100 MB at 256 x 49,152), a millisecond and more
    per sampling step. Integer ops and the exact float conversion give the same bits
    (``test_stream_uniforms_are_the_same_bits_on_the_gpu``); if compiling fails, eager."""
    global _fused_uniforms
    if _fused_uniforms is None:
        _fused_uniforms = torch.compile(uniforms, dynamic=True)
    if _fused_uniforms is not False:
        try:
            return _fused_uniforms(keys, index)
        except Exception as e:  # no working compiler here: correctness over speed
            logger.warning("fused seeded uniforms unavailable (%s); running them eagerly", e)
            _fused_uniforms = False
    return uniforms(keys, index)


def row_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:  # [rows, n] float32
    """``n`` uniforms per row: row r is the draw with key ``keys[r]``."""
    index = torch.arange(n, dtype=torch.int64, device=keys.device)
    draw = _uniforms_on_cuda if keys.is_cuda else uniforms
    return draw(keys[:, None], index[None, :])


def row_exponentials(keys: torch.Tensor, n: int) -> torch.Tensor:  # [rows, n] float32 > 0
    """``n`` Exp(1) draws per row (inverse CDF of ``row_uniforms``; never 0 or inf)."""
    return -torch.log(row_uniforms(keys, n))
