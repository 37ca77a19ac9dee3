"""Varlen inputs for a proposer's own forward over the request's paged blocks.

Proposers that keep K/V (draft models, EAGLE heads) run short chunks per request — a
catch-up over tokens they have not seen, or one draft token — at cache indices of their
choosing, through the request's block table. This builds that forward's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.device.staging import to_device, to_device_packed
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.request import Request


@dataclass
class Chunk:
    request: Request
    start: int  # cache index (and RoPE position) of the first token
    token_ids: list[int]


@dataclass
class ChunkInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_rows: torch.Tensor  # [num_chunks] int64: each chunk's last token row


def build_chunk_inputs(chunks: list[Chunk], block_size: int, device: torch.device) -> ChunkInputs:
    """Every chunk's slots must already be allocated in its request's block table."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    for chunk in chunks:
        blocks = chunk.request.block_ids
        end = chunk.start + len(chunk.token_ids)
        ids += chunk.token_ids
        pos += range(chunk.start, end)
        slots += [blocks[p // bs] * bs + p % bs for p in range(chunk.start, end)]
        q_lens.append(len(chunk.token_ids))
        seq_lens.append(end)
    width = max(len(c.request.block_ids) for c in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int32)
    for row, chunk in enumerate(chunks):
        tables[row, : len(chunk.request.block_ids)] = chunk.request.block_ids
    qsl = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    # Two staged copies (int64, int32), as for the engine's step inputs.
    n, b = len(ids), len(chunks)
    packed64 = to_device(np.array(ids + pos + slots + list(qsl[1:] - 1), dtype=np.int64), device)
    qsl_on, lens_on, tables_on = to_device_packed(
        [qsl, np.asarray(seq_lens, np.int32), tables.ravel()], device
    )
    meta = AttentionMetadata(
        slot_mapping=packed64[2 * n : 3 * n],
        query_start_loc=qsl_on,
        seq_lens=lens_on,
        block_tables=tables_on.view(b, width),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    return ChunkInputs(
        input_ids=packed64[:n],
        positions=packed64[n : 2 * n],
        meta=meta,
        last_rows=packed64[3 * n :],
    )
