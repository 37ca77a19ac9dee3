"""Projections that take the skinny Triton GEMM for steps of few tokens.

``Linear`` is ``nn.Linear`` (same parameters, same checkpoints) whose forward runs
``kernels.skinny_gemm`` when the input has at most ``max_rows`` rows, and cuBLAS
otherwise. ``max_rows`` is 0 (off) until ``use_triton_gemm`` sets it: the engine does so
on CUDA when ``EngineConfig.triton_gemm_max_tokens`` asks (off by default: in the engine
on the H200 it is slower than cuBLAS, docs/benchmarks.md); training and prefills keep
``F.linear``. On CPU, float32 inference of up to ``CPU_WEIGHT_MAJOR_MAX_ROWS`` rows
multiplies in the weight-major form (``weight_major_linear``), which MKL runs 2.5-4.4
times faster than ``x @ W.T`` at one to four rows and ~1.1 times at 16 to 32
(docs/benchmarks.md, "CPU projections").

In the engine's deterministic mode (``use_invariant_kernels``, ``models/invariant.py``)
every ``Linear`` is ``invariant``: inputs of any number of rows, prefill included, take
the Triton GEMM, whose per-row results do not depend on the row count
(``kernels/skinny_gemm.py``, "Batch invariance"); an input it cannot take raises instead
of falling back to cuBLAS, whose kernel choice (and so the row's bits) follows the batch.

A pre-norm block's entries fuse further on that path (``add_norm_linear``,
``add_norm_gate_up_silu``): the residual add and the RMSNorm run in the projection's
prologue, so a decoder layer is four launches besides attention.

Under ``torch.compile`` the kernels are custom ops (opaque nodes; dynamo cannot trace a
Triton launcher's host code), as attention is (``attention/custom_op.py``). Eager callers
launch them directly: the op dispatcher's host cost would exceed the kernel's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.module_flags import set_on_modules

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("specdec::skinny_linear", mutates_args=())
def skinny_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    from specdec.kernels.skinny_gemm import skinny_linear

    return skinny_linear(x, weight, bias)


@skinny_linear_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("specdec::gate_up_silu", mutates_args=())
def gate_up_silu_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from specdec.kernels.skinny_gemm import gate_up_silu

    return gate_up_silu(x, weight)


@gate_up_silu_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("specdec::add_rmsnorm_linear", mutates_args=())
def add_rmsnorm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from specdec.kernels.skinny_gemm import add_rmsnorm_linear

    return add_rmsnorm_linear(x, residual, norm_weight, eps, weight, bias)


@add_rmsnorm_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0]), torch.empty_like(x)


@torch.library.custom_op("specdec::add_rmsnorm_gate_up_silu", mutates_args=())
def add_rmsnorm_gate_up_silu_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    from specdec.kernels.skinny_gemm import add_rmsnorm_gate_up_silu

    return add_rmsnorm_gate_up_silu(x, residual, norm_weight, eps, weight)


@add_rmsnorm_gate_up_silu_op.register_fake
def _(x, residual, norm_weight, eps, weight):
    return x.new_empty(x.shape[0], weight.shape[0] // 2), torch.empty_like(x)


def _run(op, launcher: str, *args):
    """``op`` (the custom op) under ``torch.compile``; ``kernels.skinny_gemm``'s
    ``launcher`` directly otherwise (imported late: triton loads only when used)."""
    if torch.compiler.is_compiling():
        return op(*args)
    from specdec.kernels import skinny_gemm

    return getattr(skinny_gemm, launcher)(*args)


# On CPU, float32 inputs of up to this many rows take ``weight_major_linear``: MKL's
# kernels for ``x @ W.T`` with one row (a matrix-vector product) or a few rows stream the
# weight at a fraction of the bandwidth that its general GEMM reaches on ``W @ x.T``
# (docs/benchmarks.md, "CPU projections").
CPU_WEIGHT_MAJOR_MAX_ROWS = 32


def takes_weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference on CPU in float32 (no autograd) with at most ``CPU_WEIGHT_MAJOR_MAX_ROWS``
    rows; from about 64 rows up ``F.linear`` is as fast or faster. Traced code takes it
    too, so a compiled step multiplies as the eager one does."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and 1 <= x.shape[0] <= CPU_WEIGHT_MAJOR_MAX_ROWS
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
    )


def weight_major_linear(
    x: torch.Tensor,  # [rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [rows, out_features], contiguous
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T`` by MKL's general
    GEMM instead of its matrix-vector and few-rows kernels: the same sums up to float
    rounding (bitwise the same from a dozen rows up). One row goes in twice, since a
    one-column ``x.T`` would take the matrix-vector kernel again."""
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat([x, x])
    out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())
    return out[:, :rows].t().contiguous()


class Linear(nn.Linear):
    """``nn.Linear`` that multiplies inputs of at most ``max_rows`` rows (2-d, contiguous
    rows, a float dtype) with the skinny Triton GEMM; same results up to float rounding
    (float32 accumulation either way). ``invariant``: every input, whatever its rows.
    Otherwise CPU float32 inference of few rows takes ``weight_major_linear``."""

    max_rows: int = 0  # off; use_triton_gemm sets it per module
    invariant: bool = False  # off; use_invariant_kernels sets it per module

    def takes_triton(self, x: torch.Tensor) -> bool:
        if self.invariant:
            self._require_invariant_input(x)
            return True
        return (
            0 < x.shape[0] <= self.max_rows
            and x.dim() == 2
            and x.dtype in _FLOATS
            and x.stride(-1) == 1
        )

    def _require_invariant_input(self, x: torch.Tensor) -> None:
        if x.dim() == 2 and x.dtype == self.weight.dtype and x.stride(-1) == 1:
            return
        raise ValueError(
            f"this Linear runs the batch-invariant GEMM (deterministic mode), which takes "
            f"[rows, {self.in_features}] {self.weight.dtype} inputs with contiguous rows; "
            f"got {tuple(x.shape)} {x.dtype} with strides {x.stride()}. Pass x.reshape(-1, "
            f"{self.in_features}).contiguous() in the weight's dtype (a cuBLAS fallback "
            "would make the rows' results depend on the batch)"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_triton(x):
            return _run(skinny_linear_op, "skinny_linear", x, self.weight, self.bias)
        if takes_weight_major(x, self.weight):
            return weight_major_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` in one launch when this is an MLP's fused gate/up projection
        (no bias) and ``x`` takes the Triton path; None otherwise (run it unfused)."""
        if self.bias is not None or not self.takes_triton(x):
            return None
        return _run(gate_up_silu_op, "gate_up_silu", x, self.weight)


def _fusable(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the fused entry runs. For an ``invariant`` projection the answer must not
    change with the row count (fused and unfused norms round alike but sum in different
    orders), so it reads the module, the shapes and the dtypes only: the model's ``x`` and
    ``residual`` are always dense alike, and other layouts raise in the launcher."""
    if not isinstance(proj, Linear) or not proj.takes_triton(x):
        return False
    same = residual.shape == x.shape and residual.dtype == x.dtype
    return same and (proj.invariant or residual.stride() == x.stride())


def add_norm_linear(
    x: torch.Tensor,  # [rows, K]
    residual: torch.Tensor,  # [rows, K]
    norm: nn.Module,  # an RMSNorm: ``weight`` [K] and ``eps``
    proj: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(proj(norm(x + residual)), x + residual)`` in one launch when ``proj`` takes the
    Triton path for ``x``; None otherwise (the caller runs the modules)."""
    if not _fusable(proj, x, residual):
        return None
    args = (x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    return _run(add_rmsnorm_linear_op, "add_rmsnorm_linear", *args)


def add_norm_gate_up_silu(
    x: torch.Tensor,  # [rows, K]
    residual: torch.Tensor,  # [rows, K]
    norm: nn.Module,  # an RMSNorm
    proj: nn.Module,  # an MLP's fused gate/up projection (no bias)
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(silu(gate) * up of proj(norm(x + residual)), x + residual)`` in one launch on
    the Triton path; None otherwise."""
    if not _fusable(proj, x, residual) or proj.bias is not None:
        return None
    args = (x, residual, norm.weight, norm.eps, proj.weight)
    return _run(add_rmsnorm_gate_up_silu_op, "add_rmsnorm_gate_up_silu", *args)


def use_triton_gemm(module: nn.Module, max_rows: int) -> int:
    """Route every ``Linear`` in ``module`` with at most ``max_rows`` input rows through
    the Triton GEMM (0: cuBLAS always). Returns how many modules it set."""
    if max_rows < 0:
        raise ValueError(f"max_rows={max_rows} must be >= 0 (0 turns the Triton GEMM off)")
    return set_on_modules(module, Linear, "max_rows", max_rows)
