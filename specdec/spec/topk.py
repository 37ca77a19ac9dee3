"""How a proposer ranks a dynamic tree level's children: the Triton kernel or the
reference (``specdec.ops.topk``)."""

from __future__ import annotations

from specdec.ops.topk import LevelTopK, log_softmax_topk_ref


def level_topk_for(triton_kernels: bool) -> LevelTopK:
    """A proposer's ``LevelTopK``: the Triton kernel on the Triton (GPU) path
    (``RuntimeChoice.triton_kernels``), where the reference's nine kernels cost ~40 µs a
    level; the reference elsewhere."""
    if triton_kernels:
        from specdec.kernels.topk import log_softmax_topk

        return log_softmax_topk
    return log_softmax_topk_ref
