"""CUDA graphs for the target's steps: uniform steps, one graph per (tokens per sequence,
bucketed batch size), and steps with prefill tokens, one per (token bucket, sequence
bucket).

On the H200 a step of a small model is launch-bound (hundreds of small kernels), so steps
replay a captured graph wherever one holds them. Uniform steps (``StepGraphs``) build
their inputs in the graph's static buffers (``GraphStaging``: the host-to-device copies
land there, padded on the host, so only the block tables and a tree mask are copied on
the device); the graph runs the whole forward plus the lm_head (and the aux residual
streams a proposer reads), and the outputs come out of static buffers. Two shapes repeat:

- decode steps: every sequence computes ``q = 1`` token;
- verify steps: every sequence computes a draft tree of ``q`` nodes (root included). Their
  graphs always take the tree-mask path; a batch of chains copies in a causal mask.

A batch of ``n`` sequences uses the smallest bucket ``>= n``; padding sequences point at the
null block (slot 0) with ``q`` tokens of context and their outputs are ignored.

Steps with prefill tokens (``PrefillGraphs``: a prompt, prompt chunks, arrivals next to
decodes or next to chain verification) never repeat a shape, so they are padded into
buckets instead: extra tokens go to padding sequences on the null block, and the lm_head
runs on the logits rows only.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from specdec.device.graph_capture import capture_graph
from specdec.device.staging import aligned, to_device
from specdec.ops.attention_metadata import AttentionMetadata

ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor | None]
]
"""``forward(input_ids, positions, meta) -> (logits [n, vocab], aux [n, A] or None)``."""


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch_size`` (denser where batches are common)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


def tree_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Coarser buckets for verify steps (each graph holds ``bucket * q`` logits rows)."""
    coarse = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    sizes = [s for s in coarse if s < max_batch_size] + [max_batch_size]
    return sorted(set(sizes))


@dataclass(frozen=True)
class GraphStaging:
    """Where a step that replays graph ``(q, bucket)`` stages its inputs: in the graph's
    own static buffers, so the step's two host-to-device copies land where the graph reads
    and no device-side copy follows. ``build_step_inputs`` writes the layout:

    - ``int64``: input ids, positions, slot mapping, each ``bucket * q`` long (the rows
      past the step's tokens zero: padding sequences compute token 0 into the null
      block's slot 0), then the step's other int64 rows;
    - ``int32``: seq_lens, ``bucket`` long (padding sequences: ``q``), then the rest of
      the packed int32 parts, each starting 16 bytes apart (``staging.to_device_packed``).

    Block tables (and a tree mask) are still copied on the device: the graph reads them
    at the cache's full width, which the host does not send every step.
    """

    q: int
    bucket: int
    int64: torch.Tensor
    int32: torch.Tensor


class _Buffers:
    """Static inputs of every graph with ``q`` tokens per sequence (sized for the largest
    bucket). The token rows of bucket ``bs`` are the first ``3 * bs * q`` of ``int64``
    (ids, positions, slots; the layout of ``GraphStaging``); other inputs are prefixes."""

    def __init__(self, q: int, max_batch: int, width: int, device: torch.device) -> None:
        n = max_batch * q
        self.q = q
        # Token rows (3n), then room for the step's logits rows (<= n), tree rows (<= n)
        # and pending-token rows and sources (<= max_batch each).
        self.int64 = torch.zeros(5 * n + 2 * max_batch, dtype=torch.int64, device=device)
        # seq_lens, query_start_loc and the step's block tables (at its own width).
        size = aligned(max_batch, 4) + aligned(max_batch + 1, 4) + max_batch * width
        self.int32 = torch.zeros(size, dtype=torch.int32, device=device)
        self.seq_lens = self.int32[:max_batch]
        self.seq_lens.fill_(q)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(
            0, (max_batch + 1) * q, q, dtype=torch.int32, device=device
        )
        self.tree_lens = torch.full((max_batch,), q, dtype=torch.int32, device=device)
        self.tree_mask_offsets = torch.arange(max_batch, device=device) * (q * q)
        tril = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        self.causal = tril.repeat(max_batch, 1).flatten()  # [max_batch * q * q]
        self.tree_mask = self.causal.clone()

    def tokens(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bucket ``bs``'s input ids, positions and slot mapping: [bs * q] int64 each."""
        n = bs * self.q
        return self.int64[:n], self.int64[n : 2 * n], self.int64[2 * n : 3 * n]

    def meta(self, bs: int, max_seq_len: int) -> AttentionMetadata:
        q = self.q
        tree = {}
        if q > 1:
            tree = {
                "tree_lens": self.tree_lens[:bs],
                "tree_mask_offsets": self.tree_mask_offsets[:bs],
                "tree_mask": self.tree_mask[: bs * q * q],
                "max_tree_len": q,
            }
        return AttentionMetadata(
            slot_mapping=self.tokens(bs)[2],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=q,
            max_seq_len=max_seq_len,
            **tree,
        )


class _GraphSet:
    """Graphs keyed by a shape, captured into one shared memory pool, with their outputs:
    static tensors that every replay of that graph rewrites. Subclasses decide the keys
    and how a step's inputs reach the static buffers; tests replace ``_capture`` and
    ``_replay`` with eager stand-ins."""

    def __init__(self, forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]):
        self._forward = forward
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None

    def _capture(
        self, key: tuple[int, int], args: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Warm up, capture ``forward(*args)`` as graph ``key``; returns its outputs."""
        graph, outputs = capture_graph(lambda: self._forward(*args), self.pool)
        self.pool = graph.pool()
        self.graphs[key] = graph
        return outputs

    def _replay(self, key: tuple[int, int]) -> None:
        self.graphs[key].replay()


class StepGraphs(_GraphSet):
    """Captures ``forward`` for uniform steps. ``max_seq_len`` is captured as the model's
    context limit so that one graph serves every context length; the attention kernels stop
    at each sequence's real length."""

    def __init__(
        self,
        forward: ForwardFn,
        block_table_width: int,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        super().__init__(forward)
        self.width = block_table_width
        self.max_seq_len = max_seq_len
        self.device = device
        self._buffers: dict[int, _Buffers] = {}
        self.batch_sizes: dict[int, list[int]] = {}
        self.num_replays: dict[int, int] = {}  # per q

    def capture(self, q: int, batch_sizes: list[int]) -> None:
        """Graphs for steps of ``q`` tokens per sequence at each batch size."""
        for _ in self.captures(q, batch_sizes):
            pass

    def captures(self, q: int, batch_sizes: list[int]) -> Iterator[int]:
        """``capture``, one graph per iteration (it yields the batch size captured); a
        size serves steps (``bucket``) once its graph is captured."""
        sizes = sorted(batch_sizes)
        buffers = _Buffers(q, sizes[-1], self.width, self.device)
        self._buffers[q] = buffers
        captured = self.batch_sizes[q] = []
        # Largest first, so smaller graphs reuse the memory pool the largest one set up.
        for bs in reversed(sizes):
            input_ids, positions, _ = buffers.tokens(bs)
            args = (input_ids, positions, buffers.meta(bs, self.max_seq_len))
            self.outputs[q, bs] = self._capture((q, bs), args)
            bisect.insort(captured, bs)
            yield bs

    def bucket(self, q: int, num_seqs: int) -> int | None:
        for bs in self.batch_sizes.get(q, ()):  # captured sizes, ascending
            if bs >= num_seqs:
                return bs
        return None

    def staging(self, q: int, num_seqs: int) -> GraphStaging | None:
        """Where a step of ``num_seqs`` sequences x ``q`` tokens stages its inputs to replay
        a graph (None: no graph holds it)."""
        bs = self.bucket(q, num_seqs)
        if bs is None:
            return None
        buf = self._buffers[q]
        return GraphStaging(q, bs, buf.int64, buf.int32)

    def run(
        self,
        q: int,
        input_ids: torch.Tensor,  # [num_seqs * q] int64
        positions: torch.Tensor,  # [num_seqs * q] int64
        meta: AttentionMetadata,
        staged: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [num_seqs * q, vocab], aux
        """Replay the graph for the step. ``staged``: the inputs were built into this
        graph's buffers (``staging``; token rows and seq_lens padded on the host), so only
        the block tables and the tree mask are copied here."""
        num_seqs = meta.num_seqs
        bs = self.bucket(q, num_seqs)
        assert bs is not None, f"no graph for {num_seqs} sequences of {q} tokens"
        buf = self._buffers[q]
        n = num_seqs * q
        width = meta.block_tables.shape[1]
        if not staged:
            ids, pos, slots = buf.tokens(bs)
            ids[:n].copy_(input_ids)
            pos[:n].copy_(positions)
            slots[:n].copy_(meta.slot_mapping)
            buf.seq_lens[:num_seqs].copy_(meta.seq_lens)
            if num_seqs < bs:  # padding sequences read and write the null block only
                ids[n:].zero_()
                pos[n:].zero_()
                slots[n:].zero_()
                buf.seq_lens[num_seqs:bs].fill_(q)
        buf.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if num_seqs < bs:
            buf.block_tables[num_seqs:bs].zero_()
        if q > 1:
            mask = meta.tree_mask if meta.tree_mask is not None else buf.causal
            buf.tree_mask[: n * q].copy_(mask[: n * q])
        self._replay((q, bs))
        self.num_replays[q] = self.num_replays.get(q, 0) + 1
        logits, aux = self.outputs[q, bs]
        return logits[:n], aux[:n] if aux is not None else None


RowsForwardFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor | None],
]
"""``forward(input_ids, positions, meta, logits_indices) -> (logits [len(logits_indices),
vocab], aux [n, A] or None)``: the forward with the lm_head on the given rows only."""


def prefill_graph_buckets(
    max_tokens: int, max_seqs: int, max_model_len: int
) -> tuple[list[int], list[int]]:
    """Token buckets (powers of two from 64 up to ``max_tokens``, the last one
    ``max_tokens`` itself, never past ``max_model_len``) and sequence buckets (powers of
    two from 2 up to ``max_seqs + 1``: a step always keeps a padding sequence). Empty when
    ``max_tokens`` is 0 (the graphs off)."""
    limit = min(max_tokens, max_model_len)
    if limit < 2 or max_seqs < 1:
        return [], []
    tokens = [t for t in (2**i for i in range(6, 20)) if t < limit] + [limit]
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


class PrefillGraphs(_GraphSet):
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

    def capture(self, pool=None):
        """Capture every bucket, largest first so the smaller ones reuse its memory (pass
        the decode graphs' ``pool`` to share theirs). Returns the pool."""
        # The shared outputs, outside the graphs' pool: sized by the largest bucket, typed
        # by an eager run of the smallest.
        logits, aux = self._rows_forward(*self._stage_padding(min(self.keys)))
        largest = (self.token_buckets[-1], self.seq_buckets[-1])
        self._logits = logits.new_empty(self.num_logits(largest), logits.shape[1])
        self._aux = None if aux is None else aux.new_empty(largest[0], aux.shape[1])
        self.pool = pool
        for key in sorted(self.keys, reverse=True):
            # Capture-time inputs: an empty step, i.e. every sequence padding.
            self.outputs[key] = self._capture(key, self._stage_padding(key))
        return self.pool

    def bucket(self, num_tokens: int, num_seqs: int, num_logits: int) -> tuple[int, int] | None:
        """The graph a step of this shape replays (None: none holds it)."""
        seqs = next(
            (s for s in self.seq_buckets if s > num_seqs and s * self.logits_per_seq >= num_logits),
            None,
        )
        if seqs is None:
            return None
        need = num_tokens + seqs - num_seqs
        tokens = next((t for t in self.token_buckets if t >= need), None)
        return None if tokens is None else (tokens, seqs)

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
