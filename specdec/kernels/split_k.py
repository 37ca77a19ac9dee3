"""Device helper shared by the split-K kernels (decode, varlen): folding one split's
partial softmax state into a running one."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_partial(m_i, l_i, acc, m_s, l_s, a_s):
    """Fold a split's (running max ``m_s``, sum ``l_s``, unnormalised output ``a_s``; log2
    units, rows along dim 0) into ``(m_i, l_i, acc)``. A split that saw no key has
    ``m_s`` = -big and ``l_s`` = 0, and contributes nothing."""
    m_new = tl.maximum(m_i, m_s)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(m_s - m_new)
    return m_new, l_i * alpha + l_s * beta, acc * alpha[:, None] + a_s * beta[:, None]
