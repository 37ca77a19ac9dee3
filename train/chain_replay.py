"""Greedy chain decoding replayed on records: the steps and accepted tokens the engine
would count while generating each record's answers, from one TTT unroll of the head.

Setting. A record's *answer* is one run of loss-masked tokens ``x[p..e]`` (an assistant
turn: its reply and end-of-turn token), written as the target's greedy answer to the text
before it (``specdec data-gen regenerate --temperature 0``). A chain of ``K`` drafts rooted
at ``x[j]`` is TTT's unroll at packed index ``j - 1`` (``ttt.py``'s alignment), so its
drafts equal greedy decoding's next tokens exactly for its *leading run* of hits.

The engine's accounting, which ``replay_chain`` reproduces (``SyncStep._propose`` and
``_verify``, ``OutputProcessor._stop_status``):

- the prefill emits the answer's first token ``x[p]``; it is not a step;
- each later step roots a chain at the last emitted token and drafts
  ``min(K, max_tokens - emitted - 1)`` tokens (never past ``max_tokens``); when that is 0,
  the last token is decoded plainly, which is not a step;
- a step accepts the leading drafts equal to the target's argmax and emits them plus the
  bonus token; the request stops once it emits its end-of-turn token (EOS) or its
  ``max_tokens``-th token, dropping the step's tokens after it;
- accepted drafts past EOS still count: verification does not know the request stops
  there (vLLM counts the same way). ``checkable`` lets the replay count them where the
  record shows what the target continues with.

These are the synchronous step's rules. The pipelined step (``spec.pipeline``, on by
default with CUDA graphs) launches a full chain whatever max_tokens leaves, and the engine
counts it as the synchronous step would (``pipelined_step.counted_as_synchronous``), so the
replay holds for both.

Invariants: every answer begins after its sequence's first token (the prefill needs a
prompt); ``replay_chain`` records exactly one step per verification the engine would run,
``accepted <= drafted <= K`` in each; with ``max_tokens`` known, a record whose turn was
cut (regenerate closes it with an end-of-turn token the engine never emitted) replays as
the engine ran it: ``max_tokens`` tokens, no draft past them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.spec.metrics import SpecStats

NO_LIMIT = np.iinfo(np.int64).max  # an answer generated without a max_tokens cut


@dataclass(frozen=True)
class AnswerSpans:
    """The answers of a packed batch, in packed order."""

    start: np.ndarray  # [num_answers] int64: packed index of each answer's first token
    end: np.ndarray  # [num_answers] int64: one past its last token
    max_tokens: np.ndarray  # [num_answers] int64: the engine's max_tokens (NO_LIMIT: none)

    def __len__(self) -> int:
        return self.start.shape[0]

    def lengths(self) -> np.ndarray:  # [num_answers] int64
        """Tokens the engine emitted for each answer: its run, cut at max_tokens."""
        return np.minimum(self.end - self.start, self.max_tokens)


def answer_spans(
    loss_mask: np.ndarray,  # [n] bool
    cu_seqlens: np.ndarray,  # [num_seqs + 1] int64
    max_tokens: int | None = None,  # what the answers were generated with (None: unknown)
    clipped: np.ndarray | None = None,  # [num_seqs] bool: sequence cut short when packed
) -> AnswerSpans:
    """Maximal runs of loss-masked tokens within each sequence. A run at a sequence's first
    token starts one later (that token has no prompt before it). The last answer of a
    ``clipped`` sequence, when it reaches the cut, replays as if ``max_tokens`` had cut it
    there: the tokens past the cut are gone, so no draft may reach them."""
    n = loss_mask.shape[0]
    seq_start = np.zeros(n, dtype=bool)
    seq_start[cu_seqlens[:-1][cu_seqlens[:-1] < n]] = True
    masked = loss_mask.astype(bool) & ~seq_start
    edges = np.diff(masked.astype(np.int8), prepend=0, append=0)
    # A run also breaks where a new sequence starts (its first token is never masked here).
    start = np.flatnonzero(edges == 1).astype(np.int64)
    end = np.flatnonzero(edges == -1).astype(np.int64)
    limit = np.full(start.shape, NO_LIMIT if max_tokens is None else max_tokens, np.int64)
    if clipped is not None and clipped.any():
        seq = np.searchsorted(cu_seqlens, start, side="right") - 1  # [num_answers]
        cut = clipped[seq] & (end == cu_seqlens[seq + 1])
        limit[cut] = np.minimum(limit[cut], end[cut] - start[cut])
    return AnswerSpans(start, end, limit)


def checkable(
    input_ids: np.ndarray,  # [n] int
    loss_mask: np.ndarray,  # [n] bool
    target_top: np.ndarray,  # [n] int: the target's argmax (full vocabulary) at each index
    cu_seqlens: np.ndarray,  # [num_seqs + 1] int64
) -> np.ndarray:  # [n] bool
    """Where a draft's check against the target is the engine's: the answers, and past each
    answer's end as long as the record continues as the target would (each token the
    target's argmax after the one before it). There the record's context is the one the
    engine verifies past EOS, so its hit counts as the engine's; the chat template's glue
    after the end-of-turn token often qualifies for a token or two."""
    ok = loss_mask.astype(bool).copy()
    n = ok.shape[0]
    seq_end = np.repeat(cu_seqlens[1:], np.diff(cu_seqlens))  # [n]
    last = np.flatnonzero(ok[:-1] & ~ok[1:]) if n > 1 else np.zeros(0, dtype=np.int64)
    for e in last.tolist():
        s = e + 1
        while s < seq_end[e] and not ok[s] and input_ids[s] == target_top[s - 1]:
            ok[s] = True
            s += 1
    return ok


def chain_leading(
    hits: np.ndarray,  # [steps, n] bool: DraftTrace.hits
    ok: np.ndarray,  # [n] bool: ``checkable``
) -> np.ndarray:  # [n] int64
    """The leading run of counted hits at each index: step ``i`` at ``n`` counts iff it hit
    and its source ``n + 1 + i`` is checkable (a source past the batch never hit)."""
    steps, n = hits.shape
    counted = np.empty_like(hits)
    for i in range(steps):
        src = np.minimum(np.arange(n) + 1 + i, n - 1)
        counted[i] = hits[i] & ok[src]
    return np.cumprod(counted, axis=0).sum(axis=0).astype(np.int64)


def replay_answers(leading: np.ndarray, spans: AnswerSpans, k: int) -> list[SpecStats]:
    """The engine's speculation counters for greedy chains of ``k`` drafts, one per answer
    (module docstring). ``leading[j - 1]``: the leading run of hits of a chain rooted at
    ``x[j]`` (``chain_leading``, with at least ``k`` steps unrolled)."""
    if k < 1:
        raise ValueError(f"chain length k={k} must be >= 1")
    out = []
    runs = leading.tolist()  # host ints: the loop below runs once per step
    for start, length, limit in zip(
        spans.start.tolist(), spans.lengths().tolist(), spans.max_tokens.tolist(), strict=True
    ):
        stats = SpecStats()
        root, emitted = start, 1  # the prefill emitted the first token
        while emitted < length:
            drafts = min(k, limit - emitted - 1)
            if drafts <= 0:  # one token left: decoded plainly, not a step
                break
            accepted = min(runs[root - 1], drafts)
            stats.record(drafts, accepted)
            root += accepted + 1
            emitted += accepted + 1
        out.append(stats)
    return out


def replay_chain(leading: np.ndarray, spans: AnswerSpans, k: int) -> SpecStats:
    """``replay_answers`` pooled over the answers, as ``specdec bench`` pools requests."""
    total = SpecStats()
    for stats in replay_answers(leading, spans, k):
        total.merge(stats)
    return total


def greedy_agreement(
    input_ids: np.ndarray,  # [n] int
    target_top: np.ndarray,  # [n] int
    spans: AnswerSpans,
) -> tuple[int, int]:
    """(answer tokens after each answer's first that are the target's argmax after the
    token before them, those tokens): 1.0 when the records are the target's greedy
    answers, as the replay assumes."""
    agree = total = 0
    for start, length in zip(spans.start.tolist(), spans.lengths().tolist(), strict=True):
        s = np.arange(start + 1, start + length)
        agree += int((input_ids[s] == target_top[s - 1]).sum())
        total += s.shape[0]
    return agree, total
