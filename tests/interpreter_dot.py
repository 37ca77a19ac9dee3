"""``tl.dot`` under Triton's interpreter with a GPU's semantics, for every test.

The interpreter hands a dot's operands to numpy's matmul as stored, which departs from
the hardware twice:

- bf16 values are stored as their raw uint16 words and multiplied as integers (a 16 x 16
  product comes out ~1e10). They are widened to float32 first: bf16 products are exact
  in float32 and the sum is float32, as on the GPU.
- numpy passes the whole [M, K] x [K, N] product to BLAS, whose kernel is picked by CPU
  type at run time, and some kernels sum a row's products in an order that depends on M
  and on the row's place in the tile (edge rows take other micro-kernels): on AMD EPYC,
  OpenBLAS's Zen and Haswell kernels give a row other bits inside a 16-row tile than
  inside a 48-row one; its SkylakeX kernel does not. A GPU's matrix units give a row the
  same bits whatever the tile's other rows, and the batch-invariant kernels are built on
  that: their tests check what the kernels' own code adds (fixed reduction orders over
  keys, splits and K blocks). So each row is multiplied alone, by a call of one shape,
  [1, K] x [K, N], on every CI machine.
"""

from __future__ import annotations

import numpy as np


def install() -> bool:
    """Replace the interpreter's dot (a no-op without Triton); returns whether it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "gpu_semantics", False):
        return True

    def widen(x) -> np.ndarray:
        if x.dtype.scalar == tl.bfloat16:
            return (x.data.astype(np.uint32) << 16).view(np.float32)
        return x.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # fp8: as is
        a_data, b_data, acc = widen(a), widen(b), d.data  # [..., M, K], [..., K, N], [..., M, N]
        rows = [
            np.matmul(np.ascontiguousarray(a_data[..., i : i + 1, :]), b_data, dtype=acc.dtype)
            for i in range(a_data.shape[-2])
        ]
        return interpreter.TensorHandle(np.concatenate(rows, axis=-2) + acc, d.dtype.scalar)

    create_dot.gpu_semantics = True
    builder.create_dot = create_dot
    return True
