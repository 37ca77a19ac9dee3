"""A step's model inputs as the runner executes them (``StepInputs``), the tokens a step
in flight sampled (``PendingTokens``), and the batch's block-table array
(``block_table_array``, ``BlockTables``): shared by the engine, which builds them
(engine/input_batch.py), and the pipelined speculative step (spec/pipeline.py), which
builds its own."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from specdec.ops.attention_metadata import AttentionMetadata


@dataclass
class PendingTokens:
    """The tokens the step in flight sampled (async scheduling), still on the device: the
    next step feeds them to the model without waiting for the host to read them."""

    token_ids: torch.Tensor  # [num_sampled] int64
    rows: dict[str, int]  # request_id -> its row in token_ids


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64: token rows whose logits are needed
    sampled_rows: list[int]  # index into `scheduled` of each request that gets tokens
    logits_counts: list[int]  # logits rows of each sampled row: 1, or its tree's node count
    is_decode_only: bool
    # q when every sequence computes q tokens (all one-token decodes, or all trees padded
    # to q nodes): the shape CUDA graphs replay. Their outputs cover every token, so the
    # logits rows are then ``logits_indices`` of the graph's output.
    uniform_q: int | None = None
    staged: bool = False  # built in a CUDA graph's static buffers (cuda_graph.GraphStaging)


def block_table_array(table_rows: list[list[int]], width: int) -> np.ndarray:  # [rows, width]
    """The rows' block ids, zero-padded to ``width``: one flat copy and one scatter for
    the batch (a numpy assignment per row costs more than the row's few ids)."""
    lens = np.fromiter(map(len, table_rows), dtype=np.int64, count=len(table_rows))
    tables = np.zeros((len(table_rows), width), dtype=np.int32)
    total = int(lens.sum())
    if total:
        flat = np.fromiter(itertools.chain.from_iterable(table_rows), np.int32, count=total)
        rows = np.repeat(np.arange(len(table_rows)), lens)
        cols = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        tables[rows, cols] = flat
    return tables


class BlockTables:
    """``block_table_array`` for a batch whose rows change little from step to step (the
    same requests in the same order, a block appended now and then, a row shifted when a
    request ends). Each row keeps a copy of the ids it holds; a row whose ids are unchanged costs
    one list comparison, one that grew writes only its new ids, any other change
    rewrites the row. So a row always equals what ``block_table_array`` would build,
    however its request's blocks changed (appends, trims, preemption, a new request)."""

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width = rows, width
        self.array = np.zeros((rows, width), dtype=np.int32)  # [rows, width]
        self._held: list[list[int]] = [[] for _ in range(rows)]  # row i's ids, copied

    def update(self, table_rows: list[list[int]]) -> np.ndarray:  # [len(table_rows), width]
        """The rows' tables (a view of ``array``, valid until the next update)."""
        array, held = self.array, self._held
        for i, ids in enumerate(table_rows):
            old = held[i]
            if ids == old:
                continue
            n, m = len(old), len(ids)
            if m > self.width:
                raise ValueError(f"a block table of {m} blocks exceeds width {self.width}")
            if m > n and ids[:n] == old:  # blocks appended
                array[i, n:m] = ids[n:]
            else:
                array[i, :m] = ids
                if n > m:
                    array[i, m:n] = 0
            held[i] = list(ids)
        return array[: len(table_rows)]
