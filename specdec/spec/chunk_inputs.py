"""Varlen inputs for a proposer's own forward over the request's paged blocks.

Proposers that keep K/V (draft models, EAGLE heads) run short chunks per request — a
catch-up over tokens they have not seen, or one draft token — at cache indices of their
choosing, through the request's block table. This builds that forward's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.metadata import AttentionMetadata
from specdec.engine.request import Request


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
    tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        tables[row, : len(chunk.request.block_ids)] = torch.tensor(chunk.request.block_ids)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        query_start_loc=qsl.to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        block_tables=tables.to(device, non_blocking=True),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    return ChunkInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.tensor(pos, dtype=torch.int64).to(device, non_blocking=True),
        meta=meta,
        last_rows=(qsl[1:].long() - 1).to(device, non_blocking=True),
    )
