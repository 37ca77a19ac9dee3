"""What every kernel launcher checks and chooses before a launch.

Kept apart from the kernels so each kernel file holds only its kernel, its reference and its
launcher. Nothing here synchronises with the device: the checks read tensor metadata only,
so launchers stay usable inside CUDA-graph capture.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton.runtime.jit import JITFunction


def require_launchable(kernel: object, *tensors: torch.Tensor) -> None:
    """Raise unless ``kernel`` can run on the tensors' device.

    Kernels decorated while ``TRITON_INTERPRET=1`` was set run anywhere (slowly, on the
    host); compiled kernels need CUDA tensors.
    """
    compiled = isinstance(kernel, JITFunction)
    for t in tensors:
        if compiled and not t.is_cuda:
            raise RuntimeError(
                f"Triton kernels need CUDA tensors, got one on {t.device}; use the 'torch' "
                "attention backend on CPU, or set TRITON_INTERPRET=1 before triton is imported "
                "to run the kernels in the (slow) interpreter"
            )


def require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim (stride {t.stride(-1)}); "
            f"pass {name}.contiguous()"
        )


def require_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The paged layout of ``ops.attention_metadata``: two equal, contiguous 4-d tensors."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slot = block*block_size+offset)")


# Integer arguments that change from step to step. Triton otherwise compiles a variant per
# value class (== 1, divisible by 16, other) of each, and a request whose batch lands in a
# new combination pays that compilation on its first token (0.75-1.2 s on the H200).
RUNTIME_INTS = ("num_splits", "num_tokens", "stride_bt")

# CUDA caps grid dims y and z (x is 2**31 - 1).
MAX_GRID_YZ = 65535


def require_grid_yz(what: str, n: int) -> None:
    if n > MAX_GRID_YZ:
        raise ValueError(
            f"{what} = {n:,} exceeds the CUDA grid limit of {MAX_GRID_YZ:,} per launch; "
            "split the batch into smaller forwards"
        )


def gqa_group(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head; query head h reads KV head h // group."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for cache ``dtype``.

    fp32 caches ask for IEEE products: the default on NVIDIA (TF32) keeps only 10 mantissa
    bits and would fail the 1e-5 comparison with the reference. 16-bit inputs ignore it.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache  # launchers ask on every call, per layer
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (1 off-GPU, where occupancy is moot)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)


@dataclass(frozen=True)
class SplitPlan:
    """How a kernel splits each sequence's keys across programs (split-K)."""

    split_size: int  # keys per split at the host bound max_seq_len; a multiple of block_n
    num_splits: int  # cdiv(max_seq_len, split_size): the grid's split dimension (kernels
    # split each sequence's real length this many ways)


def plan_splits(
    num_programs: int,
    max_seq_len: int,
    block_n: int,
    device: torch.device,
    split_size: int | None = None,
) -> SplitPlan:
    """Pick the split size from host ints only (graph-safe).

    ``num_programs`` is the launch's size without splitting. Aim for about four programs
    per SM, but give every split at least four loop iterations of ``block_n`` keys so the
    partial writes and the combine stay small next to the keys read. ``split_size``
    (rounded up to a multiple of ``block_n``) overrides the choice.
    """
    max_seq_len = max(max_seq_len, 1)
    if split_size is None:
        wanted = math.ceil(4 * num_sms(device) / max(num_programs, 1))
        by_length = math.ceil(max_seq_len / (4 * block_n))
        splits = max(1, min(wanted, by_length))
        split_size = math.ceil(max_seq_len / splits)
    split_size = math.ceil(split_size / block_n) * block_n
    return SplitPlan(split_size, math.ceil(max_seq_len / split_size))
