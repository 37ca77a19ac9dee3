"""SpecExit labels from reasoning traces: pure functions of (think span, length, optional
confidence labels), whatever produced the trace.

Alignment (the serving head's): the channels at position ``t`` read the target's aux
states after token ``x[t]``, i.e. what the head knows once ``x[t]`` is written. A think
span is ``(start, end)``: ``x[start]`` is the think-start marker's last token, ``x[end]``
the think-end marker's first token (markers are token sequences, ``think_markers``; one
token each in Qwen3, three in the SmolLM2 reasoning target), and the ``L = end - start -
1`` tokens between them are the thinking. At every ``t`` in ``[start, end)`` (the head has
read the whole start marker, the end marker is still to come):

- ``progress[t] = (t - start) / L``: thinking written so far (0 after the start marker,
  1 when the end marker comes next);
- ``remaining[t] = end - 1 - t``: thinking tokens still to come (``L`` .. 0);
- ``confidence[t]``: the label of a *probe*, chosen by a hold rule (``CONFIDENCE_HOLDS``).
  The caller gives labels at probe positions (e.g. 1 if an answer forced after ``x[p]``
  already equals the trace's final answer, or the fraction of several forced answers that
  do; NaN elsewhere); the default rule, ``next_probe``, gives each position the label of
  the first probe at or after it, i.e. of the step boundary that closes the step it is in
  (after the last probe: the last probe's label).

Why hold at all: serving averages each signal over the tokens of a step (the catch-up
rows, ``DraftTree.signals``), and a step's tokens are mostly not probe positions. A
channel trained only at probes is unconstrained between them: on the reasoning target
such a head reads 0.6-0.98 at settled boundaries but 0.03-0.25 averaged over a step's
tokens, and fires no exit at the default thresholds (docs/spec_exit.md).

Why the *next* probe: serving decides at a delimiter ``x[b]`` (a probe position) from the
signals its step's proposal read, which are the tokens the target verified the step
before, i.e. the last tokens of the step that ``x[b]`` closes. The question asked there
is "is an answer forced after ``x[b]`` settled", which is probe ``b``'s label. Holding the
*previous* probe's label (``previous_probe``) teaches those tokens whether the answer was
settled when their step began, so every exit comes one step late: on the reasoning
target's labelled train traces the earliest boundary from which every probe is settled
would cut 57.9% of the thinking, the boundary after it 38.3%, and in the offline replay a
head trained with ``previous_probe`` cuts 36.3% (docs/spec_exit.md).

Positions outside the span, spans without thinking (``L = 0``) and spans without
confidence labels have no label (NaN): the loss skips them (``previous_probe`` also leaves
the span's tokens before its first probe unlabelled). A trace
without a closed span has no labels.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.models.exit_signals import canonical_signals
from specdec.think_markers import (
    Marker,
    ThinkSpan,
    as_marker,
    check_markers,
    find_think_span,
    resolve_marker,
)


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


def hold_forward(values: np.ndarray) -> np.ndarray:  # [m] float, NaN = none -> [m]
    """Each NaN replaced by the latest non-NaN value before it; leading NaNs stay."""
    known = ~np.isnan(values)
    last = np.maximum.accumulate(np.where(known, np.arange(len(values)), -1))
    return np.where(last >= 0, values[np.maximum(last, 0)], np.nan)


def hold_to_next(values: np.ndarray) -> np.ndarray:  # [m] float, NaN = none -> [m]
    """Each NaN replaced by the first non-NaN value after it; NaNs after the last known
    value take that value (all NaN stays all NaN)."""
    backward = hold_forward(values[::-1])[::-1]
    return np.where(np.isnan(backward), hold_forward(values), backward)


# How probe labels fill a span's other positions (module docstring: why ``next_probe``).
CONFIDENCE_HOLDS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "next_probe": hold_to_next,
    "previous_probe": hold_forward,
}


def check_hold(hold: str) -> str:
    if hold not in CONFIDENCE_HOLDS:
        raise ValueError(
            f"spec_exit.confidence_hold={hold!r}; choose one of {' | '.join(CONFIDENCE_HOLDS)}"
        )
    return hold


def exit_targets(
    record: ReasoningRecord, signals: Sequence[str], hold: str = "next_probe"
) -> np.ndarray:
    """Labels [n, len(signals)] float32 in ``signals``' order (canonical, see
    ``exit_signals``), NaN where a position has none; confidence filled between probes by
    ``CONFIDENCE_HOLDS[hold]`` (module docstring)."""
    signals = canonical_signals(signals)
    fill = CONFIDENCE_HOLDS[check_hold(hold)]
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
            fill(record.confidence[span.start : span.end])
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
    think_start: Marker  # ids (one int is accepted for a one-token marker)
    think_end: Marker
    confidence_hold: str = "next_probe"  # a CONFIDENCE_HOLDS key

    def __post_init__(self) -> None:
        check_hold(self.confidence_hold)
        object.__setattr__(self, "think_start", as_marker(self.think_start, "think_start"))
        object.__setattr__(self, "think_end", as_marker(self.think_end, "think_end"))
        check_markers(self.think_start, self.think_end, ("think_start", "think_end"))

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer,
        signals: Sequence[str],
        think_start: str | Sequence[int],
        think_end: str | Sequence[int],
        confidence_hold: str = "next_probe",
    ) -> ExitLabeler:
        """Resolve the think markers (text or ids) as serving does
        (``think_markers.resolve_marker``)."""
        start = resolve_marker(tokenizer, think_start, "spec_exit.think_start")
        end = resolve_marker(tokenizer, think_end, "spec_exit.think_end")
        return cls(canonical_signals(signals), start, end, confidence_hold)

    def targets(
        self,
        input_ids: np.ndarray,  # [n] int: packed sequences
        cu_seqlens: np.ndarray,  # [num_seqs + 1] int: their boundaries
        confidence: np.ndarray | None = None,  # [n] float, NaN where unknown
    ) -> np.ndarray:  # [n, len(signals)] float32, NaN where unlabeled
        parts = []
        for lo, hi in itertools.pairwise(cu_seqlens.tolist()):
            ids = input_ids[lo:hi]
            span = find_think_span(ids, self.think_start, self.think_end)
            conf = confidence[lo:hi] if confidence is not None else None
            record = ReasoningRecord(ids, span, conf)
            parts.append(exit_targets(record, self.signals, self.confidence_hold))
        if not parts:
            return np.zeros((0, len(self.signals)), dtype=np.float32)
        return np.concatenate(parts)
