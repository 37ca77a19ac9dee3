"""Top-k over a draft vocabulary in two passes, for the GPU's sake.

``torch.topk`` on CUDA gives a row ("slice") of fewer than ~20,000 elements to one thread
block when there are few rows, and that block runs a radix select over the whole row. A
dynamic tree at batch 1 asks for the top 8 of 8 rows of 16,384 draft logits per level:
on the H200 each such call takes ~75 µs, 374 µs of a 2.1 ms tree step.
Cutting each row into chunks gives the GPU many short rows at once: the top k of every
chunk, then the top k of those ``chunks * k`` survivors.

Exact: an element among its row's k largest is among its chunk's k largest, so the
second pass sees every winner and returns the same values in the same (descending)
order as one ``topk``. Among equal values the chosen indices may differ from
``torch.topk``'s (which promises no order among ties either).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK = 512
"""Elements per chunk in the first pass. A row of 16,384 becomes 32 rows of 512, and the
second pass reads 32 * k values per row: both passes stay short."""


def chunked_topk(
    x: torch.Tensor,  # [..., n]
    k: int,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # values, indices: [..., k] (descending values)
    """``x.topk(k, dim=-1)`` (sorted, largest first) computed per chunk of ``chunk``
    elements, then over the chunks' winners. Rows shorter than two chunks, not a multiple
    of ``chunk`` long, or with ``k > chunk``, take one ``topk``."""
    n = x.shape[-1]
    if n < 2 * chunk or n % chunk or k > chunk:
        top = x.topk(k, dim=-1)
        return top.values, top.indices
    lead = x.shape[:-1]
    parts = x.reshape(*lead, n // chunk, chunk).topk(k, dim=-1)  # [..., chunks, k] each
    best = parts.values.flatten(-2).topk(k, dim=-1)  # over [..., chunks * k]
    within = parts.indices.flatten(-2).gather(-1, best.indices)  # index inside its chunk
    return best.values, within + (best.indices // k) * chunk


LevelTopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``fn(scores [..., vocab], k) -> (log-probabilities [..., k] float32, descending;
columns [..., k] int64)``: how a dynamic tree level ranks children. ``scores`` are the
draft's logits or log-probabilities (the log-softmax is idempotent on the latter). The
reference is ``log_softmax_topk_ref``; ``kernels.topk.log_softmax_topk`` is the same in two
Triton launches (ties to the lowest column)."""


def log_softmax_topk_ref(
    scores: torch.Tensor,  # [..., vocab] logits (any float dtype)
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., k] float32 (descending), [..., k] int64
    """``scores.float().log_softmax(-1).topk(k)``, the top k in two passes."""
    return chunked_topk(scores.float().log_softmax(dim=-1), k)
