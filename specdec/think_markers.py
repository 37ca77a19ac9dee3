"""Think markers as token sequences: resolved against a tokenizer, matched in token streams.

A reasoning model opens and closes its thinking with marker text. In Qwen3 or DeepSeek-R1
``<think>`` and ``</think>`` are one special token each; in the SmolLM2 reasoning target
(docs/reasoning_target.md) they are plain text of three tokens each, ``<think>`` = [44,
17400, 46] and ``</think>`` = [9617, 17400, 46]. So a marker is a non-empty tuple of token
ids, and a one-token marker is just the shortest case (it takes the same code path at the
same cost: a comparison per token).

**Resolution** (``resolve_marker``): a marker given as ids (a list of ints) is used as it
is; a marker given as text is ``tokenizer.encode(text, add_special_tokens=False)``, the
ids the text has *on its own*.

**Matching**: a marker occurs where a request's tokens (prompt, then output, one stream)
hold its ids consecutively, and it takes effect at its last token. Matching is on ids,
never on text, so the ids above must be how the model writes the marker in running text.
For SmolLM2 they are: its traces (data_gen/reasoning) write ``"\\n</think>\\n\\n"`` as
[198, 9617, 17400, 46, 198, 198] and open replies with [44, 17400, 46, 198], the markers'
ids alone between newline tokens (``tests/spec/test_spec_exit_markers.py`` checks this on
every task's trace). A tokenizer that prefixes text on its own with a space (SentencePiece's
``▁``), or a marker that merges with its neighbours, writes other ids in running text:
give such a marker as ids. ``context_mismatch`` flags the common case (the ids after a
newline differ from the ids alone) so callers can warn.

Matches may straddle the prompt/output boundary and engine steps: ``MarkerMatcher`` keeps
the last ``len(longest marker) - 1`` tokens between pushes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Marker = tuple[int, ...]


def as_marker(value: int | Sequence[int], name: str = "marker") -> Marker:
    """A marker from one id or a sequence of ids (non-empty, each an int >= 0)."""
    ids = (value,) if isinstance(value, int | np.integer) else tuple(value)
    if not ids or not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{name}={value!r} must be text or a non-empty list of token ids")
    if min(ids) < 0:
        raise ValueError(f"{name}={list(ids)} holds a negative token id")
    return tuple(int(t) for t in ids)


def resolve_marker(tokenizer, value: str | Sequence[int], name: str = "marker") -> Marker:
    """``value``'s token ids (module docstring): text through ``tokenizer`` on its own,
    ids checked against the tokenizer's vocabulary."""
    if isinstance(value, str):
        ids = tokenizer.encode(value, add_special_tokens=False)
        if not ids:
            raise ValueError(f"{name}={value!r} encodes to no tokens; give its text or ids")
        return as_marker(ids, name)
    marker = as_marker(value, name)
    vocab = len(tokenizer)
    if max(marker) >= vocab:
        raise ValueError(
            f"{name}={list(marker)} holds id {max(marker)} outside this tokenizer's "
            f"vocabulary [0, {vocab}); give the served model's ids or the marker's text"
        )
    return marker


def context_mismatch(tokenizer, text: str) -> Marker | None:
    """The ids ``text`` takes after a newline when they differ from its ids alone (the
    marker would not match where the model writes it), else None."""
    alone = tokenizer.encode(text, add_special_tokens=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    after = tokenizer.encode("\n" + text, add_special_tokens=False)
    if after[: len(newline)] != newline:
        return None  # the newline merged with the text: no clean split to compare
    in_context = tuple(after[len(newline) :])
    return None if in_context == tuple(alone) else in_context


def check_markers(start: Marker, end: Marker, names: tuple[str, str]) -> None:
    """The two markers must be told apart where they complete: neither may end the other
    (completing it would complete both)."""
    for a, b, na, nb in ((start, end, *names), (end, start, *reversed(names))):
        if len(a) <= len(b) and b[len(b) - len(a) :] == a:
            raise ValueError(
                f"{na}={list(a)} ends {nb}={list(b)}: the span could not tell them apart; "
                "use markers that end differently"
            )


class MarkerMatcher:
    """Streaming match of several markers over one token stream: ``push`` each token in
    order and learn which marker (its index) the token completes, if any. The last
    ``longest - 1`` tokens are carried over, so a match may straddle pushes from
    different engine steps. ``copy`` gives an independent matcher (to look ahead)."""

    __slots__ = ("_keep", "markers", "recent")

    def __init__(self, *markers: Marker) -> None:
        self.markers = markers
        self._keep = max(len(m) for m in markers) - 1
        self.recent: tuple[int, ...] = ()  # the last `_keep` tokens pushed

    def push(self, token: int) -> int | None:
        hit = None
        for i, marker in enumerate(self.markers):
            if token == marker[-1] and (
                len(marker) == 1 or self.recent[1 - len(marker) :] == marker[:-1]
            ):
                hit = i
                break
        if self._keep:
            self.recent = (*self.recent, token)[-self._keep :]
        return hit

    def copy(self) -> MarkerMatcher:
        other = MarkerMatcher(*self.markers)
        other.recent = self.recent
        return other


def find_marker(ids: np.ndarray, marker: Marker, start: int = 0) -> int | None:
    """Index of the first token of ``marker``'s first occurrence in ``ids[start:]`` (an
    index into ``ids``), or None."""
    k = len(marker)
    tail = np.asarray(ids)[start:]
    if len(tail) < k:
        return None
    if k == 1:
        hits = np.flatnonzero(tail == marker[0])
    else:
        windows = np.lib.stride_tricks.sliding_window_view(tail, k)
        hits = np.flatnonzero((windows == np.asarray(marker)).all(axis=1))
    return start + int(hits[0]) if hits.size else None


@dataclass(frozen=True)
class ThinkSpan:
    start: int  # index of the think-start marker's last token
    end: int  # index of the think-end marker's first token

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"think span ({self.start}, {self.end}) needs 0 <= start < end")

    @property
    def num_thinking(self) -> int:
        return self.end - self.start - 1


def find_think_span(
    token_ids: Sequence[int] | np.ndarray,
    think_start: int | Sequence[int],  # a marker's ids (one int: a one-token marker)
    think_end: int | Sequence[int],
) -> ThinkSpan | None:
    """The first think-start marker and the first think-end marker after it (matched
    as whole id sequences); None when there is no start or the span never closes (an
    unfinished trace has no known end)."""
    ids = np.asarray(token_ids)
    start_ids, end_ids = as_marker(think_start), as_marker(think_end)
    first = find_marker(ids, start_ids)
    if first is None:
        return None
    start = first + len(start_ids) - 1
    end = find_marker(ids, end_ids, start + 1)
    return None if end is None else ThinkSpan(start, end)
