"""Host-side assembly of one step's model inputs from the scheduler's decision.

Everything is built with numpy on the host and moved to the device in one copy per tensor
(pinned + non_blocking on CUDA), so a step costs no device synchronisation before the
forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.attention.metadata import AttentionMetadata
from specdec.engine.scheduler import ScheduledRequest


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: rows whose logits are sampled
    sampled_rows: list[int]  # index into `scheduled` of each sampled row
    is_decode_only: bool


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_step_inputs(
    scheduled: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    block_table_width: int | None = None,
) -> StepInputs:
    """Flatten the scheduled requests into one varlen batch.

    A request is *sampled* when this step reaches its last known token (decode, or the
    final chunk of a prefill); partial prefill chunks produce no token.
    """
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [s.request.num_computed_tokens for s in scheduled]
    seq_lens = [st + q for st, q in zip(starts, q_lens, strict=True)]
    num_tokens = sum(q_lens)
    width = block_table_width or max(len(s.request.block_ids) for s in scheduled)

    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    block_tables = np.zeros((len(scheduled), width), dtype=np.int32)
    logits_indices: list[int] = []
    sampled_rows: list[int] = []
    offset = 0
    for row, (sched, start, q_len) in enumerate(zip(scheduled, starts, q_lens, strict=True)):
        request = sched.request
        blocks = np.asarray(request.block_ids, dtype=np.int64)
        block_tables[row, : len(blocks)] = blocks
        pos = np.arange(start, start + q_len, dtype=np.int64)
        input_ids[offset : offset + q_len] = request.token_ids(start, start + q_len)
        positions[offset : offset + q_len] = pos
        slot_mapping[offset : offset + q_len] = blocks[pos // block_size] * block_size + (
            pos % block_size
        )
        offset += q_len
        if start + q_len == request.num_tokens:
            logits_indices.append(offset - 1)
            sampled_rows.append(row)

    query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    meta = AttentionMetadata(
        slot_mapping=_to_device(slot_mapping, device),
        query_start_loc=_to_device(query_start_loc, device),
        seq_lens=_to_device(np.asarray(seq_lens, dtype=np.int32), device),
        block_tables=_to_device(block_tables, device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    return StepInputs(
        input_ids=_to_device(input_ids, device),
        positions=_to_device(positions, device),
        meta=meta,
        logits_indices=_to_device(np.asarray(logits_indices, dtype=np.int64), device),
        sampled_rows=sampled_rows,
        is_decode_only=max(q_lens) == 1,
    )
