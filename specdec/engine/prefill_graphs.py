"""CUDA graphs for steps with prefill tokens (a prompt, prompt chunks, arrivals next to
decodes or next to chain verification): their shapes never repeat, so they are padded
into (token bucket, sequence bucket) graphs instead. Extra tokens go to padding sequences
on the null block, and the lm_head runs on the logits rows only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from specdec.device.staging import to_device
from specdec.engine.cuda_graph import GraphSet
from specdec.ops.attention_metadata import AttentionMetadata

RowsForwardFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor | None],
]
"""``forward(input_ids, positions, meta, logits_indices) -> (logits [len(logits_indices),
vocab], aux [n, A] or None)``: the forward with the lm_head on the given rows only."""


def prefill_graph_buckets(
    max_tokens: int, max_seqs: int, max_model_len: int
) -> tuple[list[int], list[int]]:
    """Token buckets and sequence buckets for steps of up to ``limit = min(max_tokens,
    max_model_len)`` real tokens over up to ``max_seqs`` sequences. Sequence buckets:
    powers of two from 2 up to ``max_seqs + 1`` (a step always keeps a padding sequence).
    Token buckets: powers of two from 64 below ``limit``, ``limit``, and ``limit +
    max_seqs``: a step of more than ``limit - max_seqs`` tokens needs more than ``limit``
    with its padding (one token a padding sequence), and while prompts wait the scheduler
    fills every step's token budget exactly, so without that bucket those steps would run
    eagerly. Its padding stays under ``2 * max_seqs`` tokens, the longest a padding
    sequence gets; the bucket is left out where that could exceed ``max_model_len`` (the
    padding sequences' block tables hold no more). Empty when ``max_tokens`` is 0 (the
    graphs off)."""
    limit = min(max_tokens, max_model_len)
    if limit < 2 or max_seqs < 1:
        return [], []
    tokens = [t for t in (2**i for i in range(6, 20)) if t < limit] + [limit]
    if 2 * max_seqs <= max_model_len:
        tokens.append(limit + max_seqs)
    seqs = [s for s in (2**i for i in range(1, 20)) if s <= max_seqs] + [max_seqs + 1]
    return tokens, sorted(set(seqs))


class _PrefillBuffers:
    """Static inputs of every prefill graph, sized for the largest bucket; graph
    ``(T, S)`` with ``L`` logits rows reads prefixes: ``tokens[:, :T]`` (ids, positions,
    slots), ``logits_rows[:L]``, ``seq_lens[:S]``, ``query_start_loc[:S + 1]`` and
    ``block_tables[:S]``."""

    def __init__(
        self, max_tokens: int, max_seqs: int, max_logits: int, width: int, device: torch.device
    ):
        self.max_seqs = max_seqs
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)
        self.logits_rows = torch.zeros(max_logits, dtype=torch.int64, device=device)
        # seq_lens, then query_start_loc: one host-to-device copy per step.
        self.lens = torch.zeros(2 * max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, width, dtype=torch.int32, device=device)

    def meta(self, tokens: int, seqs: int, max_seq_len: int) -> AttentionMetadata:
        m = self.max_seqs
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :tokens],
            query_start_loc=self.lens[m : m + seqs + 1],
            seq_lens=self.lens[:seqs],
            block_tables=self.block_tables[:seqs],
            max_query_len=tokens,
            max_seq_len=max_seq_len,
        )


class PrefillGraphs(GraphSet):
    """CUDA graphs for steps with prefill tokens: prompts, prompt chunks and their mix with
    decodes or with chain verification, at most ``token_buckets[-1]`` tokens over at most
    ``seq_buckets[-1] - 1`` sequences, and no tree mask. Their shapes rarely repeat, so
    one graph per (token bucket ``T``, sequence bucket ``S``) is captured at the host
    bounds ``max_query_len = T`` and ``max_seq_len`` = the context limit (the attention
    kernels stop at each sequence's real lengths; tiles past them exit at once).

    Why: eager, such a step launches ~800 small kernels from Python, and on the H200 a
    SmolLM2 prefill waited ~30 ms for the host against ~2 ms of device time.

    Padding: a step of ``n`` tokens over ``s`` sequences replays the smallest ``S > s``
    and then the smallest ``T >= n + S - s``. Sequences ``s .. S - 1`` are padding: one
    token each but the last, which takes the rest; each has no context, a null block
    table and writes its tokens into the null block's slot 0, so real sequences never see
    them. Logits come only for the step's logits rows (``logits_indices``: graph ``(T, S)``
    has room for ``min(T, S * logits_per_seq)`` of them, so an engine verifying chains of
    ``q`` nodes passes ``logits_per_seq = q``), aux streams for every token; both are
    sliced to the real rows.

    Every graph writes its outputs into one pair of shared buffers (sized by the largest
    bucket; replays run one at a time), not into outputs of its own: per-graph logits
    would take ~1 GB over the buckets of a chain engine.
    """

    def __init__(
        self,
        forward: RowsForwardFn,
        block_table_width: int,
        max_seq_len: int,
        device: torch.device,
        token_buckets: list[int],
        seq_buckets: list[int],
        logits_per_seq: int = 1,
    ) -> None:
        if not token_buckets or not seq_buckets or min(seq_buckets) < 2 or logits_per_seq < 1:
            raise ValueError(
                f"token buckets {token_buckets} and sequence buckets {seq_buckets} must be "
                "non-empty, sequence buckets >= 2 (room for a padding sequence), "
                f"logits_per_seq {logits_per_seq} >= 1"
            )
        super().__init__(self._forward_shared)
        self._rows_forward = forward
        self.token_buckets = sorted(token_buckets)
        self.seq_buckets = sorted(seq_buckets)
        self.logits_per_seq = logits_per_seq
        self.max_seq_len = max_seq_len
        self._buffers = _PrefillBuffers(
            self.token_buckets[-1],
            self.seq_buckets[-1],
            self.num_logits((self.token_buckets[-1], self.seq_buckets[-1])),
            block_table_width,
            device,
        )
        # The shared outputs: logits [max rows, vocab], aux [max tokens, A] or None.
        self._logits: torch.Tensor | None = None
        self._aux: torch.Tensor | None = None
        self.num_replays = 0

    def num_logits(self, key: tuple[int, int]) -> int:
        """Logits rows graph ``key`` = (T, S) computes."""
        tokens, seqs = key
        return min(tokens, seqs * self.logits_per_seq)

    def _forward_shared(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward, its outputs copied into (and returned as views of) the shared
        buffers."""
        logits, aux = self._rows_forward(input_ids, positions, meta, logits_indices)
        out = self._logits[: logits.shape[0]]
        out.copy_(logits)
        if aux is None:
            return out, None
        out_aux = self._aux[: aux.shape[0]]
        out_aux.copy_(aux)
        return out, out_aux

    @property
    def keys(self) -> list[tuple[int, int]]:
        """Every (T, S) with room for S sequences of at least one token each."""
        return [(t, s) for t in self.token_buckets for s in self.seq_buckets if t >= s]

    def captures(self, pool=None, max_seqs: int | None = None) -> Iterator[tuple[int, int]]:
        """Capture the buckets of at most ``max_seqs`` sequences (None: all) not captured
        yet, one per iteration, which yields its key; largest first, so the smaller ones
        reuse its memory (pass the decode graphs' ``pool`` to share theirs). ``bucket``
        picks among the captured ones only, so steps replay while the rest wait."""
        if self._logits is None:
            # The shared outputs, outside the graphs' pool: sized by the largest bucket,
            # typed by an eager run of the smallest.
            logits, aux = self._rows_forward(*self._stage_padding(min(self.keys)))
            largest = (self.token_buckets[-1], self.seq_buckets[-1])
            self._logits = logits.new_empty(self.num_logits(largest), logits.shape[1])
            self._aux = None if aux is None else aux.new_empty(largest[0], aux.shape[1])
        if pool is not None:
            self.pool = pool
        for key in sorted(self.keys, reverse=True):
            if key in self.outputs or (max_seqs is not None and key[1] > max_seqs):
                continue
            # Capture-time inputs: an empty step, i.e. every sequence padding.
            self.outputs[key] = self._capture(key, self._stage_padding(key))
            yield key

    def bucket(self, num_tokens: int, num_seqs: int, num_logits: int) -> tuple[int, int] | None:
        """The captured graph a step of this shape replays (None: none holds it): the
        smallest sequence bucket with room for a padding sequence and the logits rows,
        then the smallest token bucket for the tokens and the padding."""
        for seqs in self.seq_buckets:
            if seqs <= num_seqs or seqs * self.logits_per_seq < num_logits:
                continue
            need = num_tokens + seqs - num_seqs
            tokens = next(
                (t for t in self.token_buckets if t >= need and (t, seqs) in self.outputs), None
            )
            if tokens is not None:
                return tokens, seqs
        return None

    def _stage_padding(self, key: tuple[int, int]) -> tuple:
        """Stage an all-padding step of graph ``key``; returns the forward's arguments:
        views of the static buffers, which every replay reads."""
        empty = torch.empty(0, dtype=torch.int64, device=self._buffers.tokens.device)
        return self.stage(
            key,
            empty,
            empty,
            AttentionMetadata(
                slot_mapping=self._buffers.tokens[2, :0],
                query_start_loc=self._buffers.lens[:1],
                seq_lens=self._buffers.lens[:0],
                block_tables=self._buffers.block_tables[:0],
                max_query_len=0,
                max_seq_len=0,
                query_lens_cpu=[],
                seq_lens_cpu=[],
            ),
            empty,
        )

    def _host_lens(
        self, q_lens: list[int], seq_lens: list[int], tokens: int, seqs: int
    ) -> np.ndarray:  # [2 * max_seqs + 1] int32
        """seq_lens then query_start_loc of a step padded to (``tokens``, ``seqs``), laid
        out as ``_PrefillBuffers.lens``."""
        s, m = len(q_lens), self._buffers.max_seqs
        pad = [1] * (seqs - s - 1) + [tokens - sum(q_lens) - (seqs - s - 1)]
        lens = np.zeros(2 * m + 1, dtype=np.int32)
        lens[:s] = seq_lens
        lens[s:seqs] = pad  # padding sequences have no context: seq_len = q_len
        np.cumsum(q_lens + pad, out=lens[m + 1 : m + seqs + 1])
        return lens

    def stage(
        self,
        key: tuple[int, int],
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,  # with query_lens_cpu and seq_lens_cpu; no tree
        logits_indices: torch.Tensor,  # [num_logits] int64
    ) -> tuple:  # (ids [T], positions [T], meta, logits rows [L]): the graph's inputs
        """Copy a step into graph ``key``'s static buffers, padded as the class docstring
        says, and return the views the graph reads (what ``forward`` gets)."""
        tokens, seqs = key
        rows = self.num_logits(key)
        buf = self._buffers
        n, s, num_logits = input_ids.shape[0], meta.num_seqs, logits_indices.shape[0]
        if meta.query_lens_cpu is None or meta.seq_lens_cpu is None or meta.has_tree:
            raise ValueError("a prefill graph step needs query_lens_cpu, seq_lens_cpu, no tree")
        if n + seqs - s > tokens or s >= seqs or num_logits > rows:
            raise ValueError(
                f"{n} tokens, {s} sequences and {num_logits} logits rows do not fit graph "
                f"{key} (tokens, sequences) with its padding sequence: use bucket()"
            )
        buf.tokens[0, :n].copy_(input_ids)
        buf.tokens[1, :n].copy_(positions)
        buf.tokens[2, :n].copy_(meta.slot_mapping)
        buf.tokens[:, n:tokens].zero_()  # padding: token 0 at position 0 into slot 0
        # Rows past the step's are zeroed, not left as a larger graph's (out of range here).
        buf.logits_rows[:num_logits].copy_(logits_indices)
        buf.logits_rows[num_logits:rows].zero_()
        buf.block_tables[:s, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        buf.block_tables[s:seqs].zero_()  # padding sequences: the null block
        host = self._host_lens(list(meta.query_lens_cpu), list(meta.seq_lens_cpu), tokens, seqs)
        to_device(host, buf.lens.device, buf.lens)
        return (
            buf.tokens[0, :tokens],
            buf.tokens[1, :tokens],
            buf.meta(tokens, seqs, self.max_seq_len),
            buf.logits_rows[:rows],
        )

    def run(
        self,
        key: tuple[int, int],
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] int64
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [num_logits, vocab], aux [n, A]
        """Stage the step in graph ``key``, replay it, and return views of its outputs
        (rewritten by the next replay of any prefill graph)."""
        self.stage(key, input_ids, positions, meta, logits_indices)
        self._replay(key)
        self.num_replays += 1
        logits, aux = self.outputs[key]
        n = input_ids.shape[0]
        return logits[: logits_indices.shape[0]], aux[:n] if aux is not None else None
