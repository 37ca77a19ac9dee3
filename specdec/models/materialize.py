"""Meta-device modules made real: uninitialised storage, for a checkpoint to fill.

Loaders build a module on the meta device (no random init, no memory), then give each
parameter and buffer empty storage on the target device and copy the checkpoint in.
``materialize`` is that middle step, ``module.to(dtype).to_empty(device=device)``, by
``torch.empty`` per tensor: ``to_empty`` calls ``empty_like`` on meta tensors, which runs
through ``torch._refs`` and imports sympy and the symbolic-shapes machinery on first use
(~0.4 s of a CPU start-up that compiles nothing).
"""

from __future__ import annotations

import torch
from torch import nn


def materialize(module: nn.Module, dtype: torch.dtype, device: str | torch.device) -> None:
    """Replace every parameter and buffer of ``module`` (in place) with uninitialised
    storage on ``device``: floating-point ones in ``dtype``, the others in their own dtype,
    parameters keeping ``requires_grad``. A parameter shared by two submodules becomes two:
    re-tie it afterwards. Buffers keep their persistence."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            empty = _empty_like(param, dtype, device)
            setattr(sub, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, _empty_like(buffer, dtype, device))


def _empty_like(t: torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
