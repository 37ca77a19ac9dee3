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
    add_rmsnorm_gate_up_silu,
    add_rmsnorm_gate_up_silu_ref,
    add_rmsnorm_linear,
    add_rmsnorm_linear_ref,
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


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_prologue_equals_add_rmsnorm_then_the_projection(
    m: int, n: int, k: int, with_residual: bool
) -> None:
    """A block's entry in one launch: the stream (x + residual), its RMSNorm and the
    projection (with a bias), or gate/up with SiLU; the stream comes back too."""
    x, w = _inputs(m, 2 * n, k, seed=3 * m + k)
    gen = torch.Generator().manual_seed(n)
    residual = torch.randn(m, k, generator=gen).to(DEVICE) if with_residual else None
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(DEVICE)
    bias = torch.randn(2 * n, generator=gen).to(DEVICE)
    out, stream = add_rmsnorm_linear(x, residual, norm_w, 1e-5, w, bias)
    ref_out, ref_stream = add_rmsnorm_linear_ref(x, residual, norm_w, 1e-5, w, bias)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(stream, ref_stream)
    act, stream = add_rmsnorm_gate_up_silu(x, residual, norm_w, 1e-5, w)
    ref_act, ref_stream = add_rmsnorm_gate_up_silu_ref(x, residual, norm_w, 1e-5, w)
    torch.testing.assert_close(act, ref_act, atol=1e-5, rtol=1e-5)
    assert torch.equal(stream, ref_stream)


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
    with pytest.raises(ValueError, match=r"norm weight \(15,\) must be \[16\]"):
        add_rmsnorm_linear(x, None, torch.ones(15, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match=r"residual \(3, 16\) .* must match x \(2, 16\)"):
        add_rmsnorm_linear(
            x, torch.zeros(3, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-5, w
        )


def test_explicit_tiles_are_honoured() -> None:
    x, w = _inputs(5, 40, 72, seed=2)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=2, num_stages=2)
    torch.testing.assert_close(
        skinny_linear(x, w, config=cfg), skinny_linear_ref(x, w), atol=1e-5, rtol=1e-5
    )


def test_measured_tiles_override_the_default_rule(tmp_path, monkeypatch) -> None:
    """``$SPECDEC_GEMM_TILES`` (a tuning run's output) picks the tile per (N, K); other
    shapes keep the rule, and results stay exact."""
    from specdec.kernels import skinny_gemm as sg

    path = tmp_path / "tiles.json"
    path.write_text('{"40,72": {"block_n": 32, "block_k": 32, "num_warps": 2}}')
    monkeypatch.setenv(sg.TILES_ENV, str(path))
    sg._measured_tiles.cache_clear()
    assert choose_gemm_config(5, 40, 72) == GemmConfig(block_n=32, block_k=32, num_warps=2)
    assert choose_gemm_config(5, 48, 72) == GemmConfig(block_n=16)
    x, w = _inputs(5, 40, 72, seed=4)
    torch.testing.assert_close(skinny_linear(x, w), skinny_linear_ref(x, w), atol=1e-5, rtol=1e-5)
