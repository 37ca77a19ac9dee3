"""The skinny Triton GEMMs equal their PyTorch references (``F.linear``; the MLP's
``silu(gate) * up``), whatever the rows, tails and tiles.

Runs on CUDA when present, else on CPU under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from specdec.kernels.skinny_gemm import (
    GemmConfig,
    choose_gemm_config,
    gate_up_silu,
    gate_up_silu_ref,
    skinny_linear,
    skinny_linear_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (rows, N, K): one row; a full 16-row tile; two row tiles; N and K off the tile sizes.
SHAPES = [(1, 48, 64), (5, 40, 72), (16, 96, 200), (23, 130, 136)]


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE)
    return x, w


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear(m: int, n: int, k: int, bias: bool) -> None:
    x, w = _inputs(m, n, k, seed=m + n)
    b = torch.randn(n).to(DEVICE) if bias else None
    got = skinny_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, skinny_linear_ref(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gate_up_silu_equals_the_unfused_mlp_half(m: int, n: int, k: int) -> None:
    x, w = _inputs(m, 2 * n, k, seed=7 * m + n)
    got = gate_up_silu(x, w)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, gate_up_silu_ref(x, w), atol=1e-5, rtol=1e-5)


def test_wide_outputs_take_wide_column_tiles() -> None:
    """An LM-head-sized output (> 4096 columns) uses 64-column tiles: still exact."""
    assert choose_gemm_config(3, 5000, 64).block_n == 64
    x, w = _inputs(3, 5000, 64, seed=3)
    torch.testing.assert_close(skinny_linear(x, w), skinny_linear_ref(x, w), atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_shapes_and_the_fix() -> None:
    x, w = _inputs(2, 8, 16, seed=1)
    with pytest.raises(ValueError, match=r"x \(2, 16\) and weight \(8, 12\)"):
        skinny_linear(x, w[:, :12].contiguous())
    with pytest.raises(ValueError, match=r"x is torch.float32 but weight is torch.float64"):
        skinny_linear(x, w.double())
    with pytest.raises(ValueError, match=r"weight must be contiguous in its last dim"):
        skinny_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match=r"gate_up weight has 7 rows"):
        gate_up_silu(x, w[:7])


def test_explicit_tiles_are_honoured() -> None:
    x, w = _inputs(5, 40, 72, seed=2)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=2, num_stages=2)
    torch.testing.assert_close(
        skinny_linear(x, w, config=cfg), skinny_linear_ref(x, w), atol=1e-5, rtol=1e-5
    )
