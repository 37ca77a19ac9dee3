"""SpecExit labels from reasoning traces: pure functions of (think span, length, optional
confidence labels), whatever produced the trace.

Alignment (the serving head's): the channels at position ``t`` read the target's aux
states after token ``x[t]``, i.e. what the head knows once ``x[t]`` is written. A think
span is ``(start, end)``: ``x[start]`` is the think-start token, ``x[end]`` the think-end
token, and the ``L = end - start - 1`` tokens between them are the thinking. At every
``t`` in ``[start, end)`` (the head has read the start token, the end token is still to
come):

- ``progress[t] = (t - start) / L``: thinking written so far (0 after the start token,
  1 when the next token is the end token);
- ``remaining[t] = end - 1 - t``: thinking tokens still to come (``L`` .. 0);
- ``confidence[t]``: given per position by the caller (e.g. 1 if an answer forced after
  ``x[t]`` is already correct by the task's verifier, or the fraction of several forced
  answers that are), NaN where unknown.

Positions outside the span, spans without thinking (``L = 0``) and unknown confidences
have no label (NaN): the loss skips them. A trace without a closed span has no labels.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.models.exit_signals import canonical_signals


@dataclass(frozen=True)
class ThinkSpan:
    start: int  # index of the think-start token
    end: int  # index of the think-end token

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"think span ({self.start}, {self.end}) needs 0 <= start < end")

    @property
    def num_thinking(self) -> int:
        return self.end - self.start - 1


@dataclass(frozen=True)
class ReasoningRecord:
    """One trace as any source gives it: token ids, its think span (None: no span) and,
    optionally, per-position confidence labels (NaN where unknown)."""

    token_ids: np.ndarray  # [n] int
    think_span: ThinkSpan | None
    confidence: np.ndarray | None = None  # [n] float in [0, 1] or NaN

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.think_span is not None and self.think_span.end >= n:
            raise ValueError(
                f"think span ends at {self.think_span.end} but the trace has {n} tokens"
            )
        if self.confidence is not None and len(self.confidence) != n:
            raise ValueError(
                f"confidence has {len(self.confidence)} labels for a {n}-token trace; give one "
                "per position (NaN where unknown)"
            )


def find_think_span(
    token_ids: Sequence[int] | np.ndarray, think_start_id: int, think_end_id: int
) -> ThinkSpan | None:
    """The first think-start token and the first think-end token after it; None when
    there is no start or the span never closes (an unfinished trace has no known end)."""
    ids = np.asarray(token_ids)
    starts = np.flatnonzero(ids == think_start_id)
    if not starts.size:
        return None
    ends = np.flatnonzero(ids[starts[0] + 1 :] == think_end_id)
    if not ends.size:
        return None
    start = int(starts[0])
    return ThinkSpan(start, start + 1 + int(ends[0]))


def exit_targets(record: ReasoningRecord, signals: Sequence[str]) -> np.ndarray:
    """Labels [n, len(signals)] float32 in ``signals``' order (canonical, see
    ``exit_signals``), NaN where a position has none (module docstring)."""
    signals = canonical_signals(signals)
    n = len(record.token_ids)
    out = np.full((n, len(signals)), np.nan, dtype=np.float32)
    span = record.think_span
    if span is None or span.num_thinking == 0:
        return out
    t = np.arange(span.start, span.end)  # positions inside the span
    columns = {
        "progress": (t - span.start) / span.num_thinking,
        "remaining": (span.end - 1 - t).astype(np.float64),
        "confidence": (
            record.confidence[span.start : span.end]
            if record.confidence is not None
            else np.full(t.shape, np.nan)
        ),
    }
    for j, name in enumerate(signals):
        out[span.start : span.end, j] = columns[name]
    return out


@dataclass(frozen=True)
class ExitLabeler:
    """Labels for packed batches: think spans found in each sequence's token ids
    (``find_think_span``), confidence from an optional per-position array."""

    signals: tuple[str, ...]
    think_start_id: int
    think_end_id: int

    @classmethod
    def for_tokenizer(
        cls, tokenizer, signals: Sequence[str], think_start: str, think_end: str
    ) -> ExitLabeler:
        """Resolve the think markers, each of which must be one token of ``tokenizer``."""
        ids = []
        for name, text in (("think_start", think_start), ("think_end", think_end)):
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"spec_exit.{name}={text!r} is {len(encoded)} tokens {encoded} for the "
                    "target's tokenizer; use its single think-marker token"
                )
            ids.append(int(encoded[0]))
        return cls(canonical_signals(signals), ids[0], ids[1])

    def targets(
        self,
        input_ids: np.ndarray,  # [n] int: packed sequences
        cu_seqlens: np.ndarray,  # [num_seqs + 1] int: their boundaries
        confidence: np.ndarray | None = None,  # [n] float, NaN where unknown
    ) -> np.ndarray:  # [n, len(signals)] float32, NaN where unlabeled
        parts = []
        for lo, hi in itertools.pairwise(cu_seqlens.tolist()):
            ids = input_ids[lo:hi]
            span = find_think_span(ids, self.think_start_id, self.think_end_id)
            conf = confidence[lo:hi] if confidence is not None else None
            parts.append(exit_targets(ReasoningRecord(ids, span, conf), self.signals))
        if not parts:
            return np.zeros((0, len(self.signals)), dtype=np.float32)
        return np.concatenate(parts)
