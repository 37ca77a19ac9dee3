"""A dynamic tree level's ranking in two launches (Triton): the top k log-probabilities of
each row of draft logits, next to the PyTorch reference.

A dynamic tree (EAGLE-2) ranks every frontier node's children by log-probability. As
torch ops a level is a log-softmax over the draft vocabulary (five reductions and an
elementwise kernel once inductor has fused them) and ``ops.topk.chunked_topk`` (two
``torch.topk`` calls, each a radix select plus a bitonic sort): nine kernels and ~40 µs of
a ~108 µs level on the H200 at batch 1 (a profiled tree step). On the same GPU the two
launches here take ~9 µs (docs/benchmarks.md, "Kernel micro-benchmarks").

Here the first launch gives each (row, chunk of ``BLOCK`` ids) one program that reduces
its chunk to a running max, a sum of exponentials and its ``k`` best (value, id) pairs;
the second gives each row one program that merges the chunks' normaliser into the row's
log-sum-exp and the ``chunks * k`` survivors into the row's ``k`` best. The chunk's top k
is exact for the row (an element among its row's k largest is among its chunk's k
largest), as in ``chunked_topk``.

Ties go to the lowest id, in both passes (a chunk's equal values by id, the merge's by
chunk, then rank within the chunk), so the kernel is deterministic; ``torch.topk``
promises no order among ties, so the reference may pick another of the tied ids. Values
equal the reference's up to float rounding of the log-sum-exp (both are float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.launch import next_power_of_2, require_last_dim_contiguous, require_launchable
from specdec.ops.topk import log_softmax_topk_ref

__all__ = ["log_softmax_topk", "log_softmax_topk_ref"]

BLOCK = 1024
"""Ids per first-pass program: a 16,384-id draft vocabulary is 16 chunks, so the merge
reads 16 * k candidates per row."""
MAX_K = 64


@triton.jit
def _chunk_topk_kernel(
    x_ptr,  # [rows, vocab]
    val_ptr,  # out [rows, chunks, K] float32: the chunk's K best logits, descending
    idx_ptr,  # out [rows, chunks, K] int32: their ids (vocab where the chunk ran short)
    max_ptr,  # out [rows, chunks] float32: the chunk's max logit
    sum_ptr,  # out [rows, chunks] float32: sum of exp(logit - max) over the chunk
    vocab,
    stride_row,
    num_chunks,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = ids < vocab
    x = tl.load(x_ptr + row * stride_row + ids, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk adds nothing
    s = tl.sum(tl.where(valid, tl.exp(x - m_safe), 0.0), axis=0)
    out = (row * num_chunks + chunk) * K
    tl.store(max_ptr + row * num_chunks + chunk, m)
    tl.store(sum_ptr + row * num_chunks + chunk, s)
    taken = ~valid
    for r in tl.static_range(K):
        v = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        pick = tl.min(tl.where(~taken & (x == v), ids, vocab), axis=0)  # lowest id on ties
        tl.store(val_ptr + out + r, v)
        tl.store(idx_ptr + out + r, pick)
        taken = taken | (ids == pick)


@triton.jit
def _merge_topk_kernel(
    val_ptr,  # [rows, chunks, K] float32
    idx_ptr,  # [rows, chunks, K] int32
    max_ptr,  # [rows, chunks] float32
    sum_ptr,  # [rows, chunks] float32
    out_val_ptr,  # out [rows, K] float32: log-probabilities, descending
    out_idx_ptr,  # out [rows, K] int64
    vocab,
    num_chunks,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < num_chunks
    m = tl.load(max_ptr + row * num_chunks + c, mask=c_ok, other=float("-inf"))
    s = tl.load(sum_ptr + row * num_chunks + c, mask=c_ok, other=0.0)
    top = tl.max(m, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - top_safe))
    lse = top_safe + tl.log(tl.sum(s * scale, axis=0))
    pos = tl.arange(0, BLOCK_N)  # candidate = chunk * K + rank: chunk order is id order
    n_ok = pos < num_chunks * K
    base = row * num_chunks * K
    vals = tl.load(val_ptr + base + pos, mask=n_ok, other=float("-inf"))
    ids = tl.load(idx_ptr + base + pos, mask=n_ok, other=0)
    taken = ~n_ok | (ids >= vocab)
    for r in tl.static_range(K):
        v = tl.max(tl.where(taken, float("-inf"), vals), axis=0)
        pick = tl.min(tl.where(~taken & (vals == v), pos, BLOCK_N), axis=0)
        tok = tl.sum(tl.where(pos == pick, ids, 0), axis=0)
        tl.store(out_val_ptr + row * K + r, v - lse)
        tl.store(out_idx_ptr + row * K + r, tok.to(tl.int64))
        taken = taken | (pos == pick)


def _launch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    lead, vocab = x.shape[:-1], x.shape[-1]
    if not 1 <= k <= min(vocab, MAX_K):
        raise ValueError(f"k={k} must be in [1, min(vocab={vocab}, {MAX_K})]")
    require_last_dim_contiguous("x", x)
    require_launchable(_chunk_topk_kernel, x)
    rows2d = x.reshape(-1, vocab)  # a view for the engine's [batch, n, vocab] logits
    rows = rows2d.shape[0]
    values = torch.empty(*lead, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(*lead, k, dtype=torch.int64, device=x.device)
    if rows == 0:
        return values, ids
    chunks = triton.cdiv(vocab, BLOCK)
    cand_val = torch.empty(rows, chunks, k, dtype=torch.float32, device=x.device)
    cand_idx = torch.empty(rows, chunks, k, dtype=torch.int32, device=x.device)
    chunk_max = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    chunk_sum = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    _chunk_topk_kernel[(rows, chunks)](
        rows2d, cand_val, cand_idx, chunk_max, chunk_sum, vocab, rows2d.stride(0), chunks,
        K=k, BLOCK=BLOCK,
    )  # fmt: skip
    _merge_topk_kernel[(rows,)](
        cand_val, cand_idx, chunk_max, chunk_sum, values, ids, vocab, chunks,
        K=k, BLOCK_C=next_power_of_2(chunks), BLOCK_N=next_power_of_2(chunks * k),
    )  # fmt: skip
    return values, ids


# Opaque to torch.compile (the draft side compiles as one region around it), as attention
# and the skinny GEMMs are: Dynamo would otherwise trace the launcher's host code.
@torch.library.custom_op("specdec::log_softmax_topk", mutates_args=())
def _log_softmax_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, k)


@_log_softmax_topk_op.register_fake
def _(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int64)


def log_softmax_topk(
    x: torch.Tensor,  # [..., vocab] logits, contiguous in the last dim
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., k] float32 (descending), ids [..., k]
    """``log_softmax_topk_ref`` in two launches; ties to the lowest id."""
    values, ids = _log_softmax_topk_op(x, k)
    return values, ids
