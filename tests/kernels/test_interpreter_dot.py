"""The test harness's ``tl.dot`` under the interpreter (tests/interpreter_dot.py): a row's
bits do not depend on the tile's other rows or on how many there are, and bf16 operands
multiply as numbers, as on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's dot only"
)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = tl.dot(a, b, tl.zeros((M, N), tl.float32))
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32)
    _dot_kernel[(1,)](a, b, out, a.shape[0], a.shape[1], b.shape[1])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_tile(dtype):
    torch.manual_seed(0)
    a = torch.randn(64, 128).to(dtype)  # [M, K]
    b = torch.randn(128, 64).to(dtype)  # [K, N]
    whole = dot(a, b)
    for rows in (slice(0, 16), slice(16, 32), slice(40, 41), slice(32, 64)):
        assert torch.equal(dot(a[rows].contiguous(), b), whole[rows]), rows
    # Still a matrix product.
    torch.testing.assert_close(whole, a.float() @ b.float(), rtol=1e-4, atol=1e-3)
