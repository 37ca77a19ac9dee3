"""Switch a model onto batch-invariant kernels: the engine's deterministic mode
(``EngineConfig.deterministic``) for the target's path outside attention.

A token's logits must come out bit for bit the same whatever the step that computes it:
the number of query rows, the batch around it, the chunking of its prompt, and whether it
arrives as a prefill, decode or verified draft token. Per op on ``models.llama``'s path:

- projections (q/k/v, o, gate/up, down, the LM head): ``Linear.invariant``, the Triton
  GEMM of ``kernels/skinny_gemm.py`` at every row count, with its fused entries (residual
  add + RMSNorm + qkv; add + RMSNorm + gate/up + SiLU); never cuBLAS;
- RMSNorms (the final norm, Qwen3's per-head q/k norms, any unfused entry):
  ``RMSNorm.invariant``, one Triton program per row (``kernels/rmsnorm.py``);
- row-wise or elementwise already, so invariant as they are: the embedding (a gather),
  the RoPE cos/sin (a gather from a table built per position, ``models/rope.py``) and
  ``apply_rotary`` (Qwen3; elementwise, each op rounded on its own), the residual adds
  (one rounding each), SiLU * up outside the fused kernel (elementwise), the aux states
  (a sum and a copy), the logits' float32 cast, and greedy sampling's argmax (per row,
  first index on ties);
- attention: the backend's concern (the "triton_invariant" backend in deterministic
  mode); nothing here touches it.

Elementwise chains stay exact only as eager modules: ``torch.compile`` fuses them into
kernels that round once where eager rounds per op, so deterministic mode keeps the
target's layers uncompiled (``engine/runtime.py``), CUDA graphs capturing the eager
kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.linear import Linear
from specdec.models.llama import RMSNorm
from specdec.models.module_flags import set_on_modules

# Modules that may hold parameters on an invariant path: each has a batch-invariant
# forward (an embedding is a gather). Anything else with weights is refused.
_COVERED = (Linear, RMSNorm, nn.Embedding)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def use_invariant_kernels(model: nn.Module) -> int:
    """Run every ``Linear`` and ``RMSNorm`` in ``model`` on its batch-invariant Triton
    kernel, at every row count. Returns how many modules it set.

    Raises ``ValueError`` naming the module when something on the path has no invariant
    kernel (a module with weights of another type, a weight dtype the GEMM does not
    take), before anything is switched: a partly switched model would differ silently."""
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and not isinstance(module, _COVERED):
            raise ValueError(
                f"module {name or type(model).__name__!r} ({type(module).__name__}) holds "
                "weights but has no batch-invariant kernel (covered: "
                f"{', '.join(c.__name__ for c in _COVERED)}); deterministic mode cannot run "
                "this model: turn deterministic off"
            )
        if isinstance(module, Linear) and module.weight.dtype not in _FLOATS:
            raise ValueError(
                f"{name}.weight is {module.weight.dtype}; the batch-invariant GEMM takes "
                f"{', '.join(str(d) for d in _FLOATS)} weights: load the model in one of "
                "them (dtype=bfloat16) or turn deterministic off"
            )
    return set_on_modules(model, (Linear, RMSNorm), "invariant", True)
