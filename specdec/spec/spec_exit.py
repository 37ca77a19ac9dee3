"""SpecExit: end a reasoning model's thinking once the draft head says the answer is settled.

An EAGLE-3 head with exit channels (``Eagle3Config.exit_signals``) reads, next to each draft
tree, signals about the think span the request is in (``specdec.models.exit_signals``):
confidence, progress, remaining tokens. Per request, the policy here smooths them over
steps and, after a step's acceptance, decides whether to cut (docs/spec_exit.md):

- only for a request that opted in (``SamplingParams.spec_exit``, a ``SpecExitParams``:
  ``specdec.spec_exit_params``);
- only inside a think span: after the think-start marker, before the think-end marker
  (from the prompt on: a chat template may open the span). Markers are token sequences
  (``specdec.think_markers``: one special token in Qwen3 / DeepSeek-R1, three plain-text tokens in
  the SmolLM2 reasoning target), matched in the request's token stream across steps;
- only at a step delimiter (``"\\n\\n"`` by default) among the tokens the step emitted
  (its accepted drafts and the bonus token, all the target's own), never mid-step;
- only when every enabled signal's smoothed value passes its threshold.

Then the step keeps its tokens through the first such delimiter and the think-end
marker's tokens are forced next (``ExitCut``); the engine discards the rest and rolls back
their K/V.

A step's signals are those its proposal read: the mean over the tokens the target verified
in the request's previous step, so the decision trails the text by one step. Smoothing
(``SMOOTHERS``) runs over steps inside a span and restarts when a span opens; a step whose
tree carries no signals leaves it unchanged. Everything here is plain Python: the engine
hands in token ids, token texts and host floats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from specdec.spec_exit_params import SMOOTHERS, Smoother, SpecExitParams
from specdec.think_markers import Marker, MarkerMatcher, as_marker, check_markers


@dataclass(frozen=True)
class ExitCut:
    """A decided exit: keep the step's first ``keep`` emitted tokens (through the
    delimiter), then emit ``tokens`` (the think-end marker, all of its ids). ``saved`` is
    the smoothed remaining-tokens signal at the exit (0 when the head does not predict
    it)."""

    keep: int
    tokens: Marker
    saved: float


@dataclass
class SpecExitState:
    """One opted-in request: where its think span stands and its smoothed signals.

    ``num_scanned`` output tokens have been folded into ``in_think``, ``markers`` (the
    last tokens, so a marker split over steps or over the prompt/output boundary still
    matches) and ``tail`` (the last characters of the text, enough to match the longest
    delimiter); ``step`` first folds in the tokens appended since (plain steps and forced
    markers included), so the state always describes the request's tokens before the
    step being judged. The span opens and closes at a marker's last token.
    """

    params: SpecExitParams
    signals: tuple[str, ...]  # the head's signals, in the order trees carry them
    enabled: tuple[str, ...]  # the thresholded subset (non-empty)
    think_start: Marker  # resolved ids (one int is accepted for a one-token marker)
    think_end: Marker
    text_of: Callable[[int], str]  # a token id's text
    in_think: bool = False
    tail: str = ""
    num_scanned: int = 0
    smoother: Smoother | None = None  # created when a span opens
    smoothed: list[float] | None = None
    num_exits: int = 0
    tokens_saved: float = 0.0  # sum of ``ExitCut.saved``
    markers: MarkerMatcher = field(init=False)
    _max_delim: int = field(init=False, default=0)

    _START: ClassVar[int] = 0  # MarkerMatcher indices
    _END: ClassVar[int] = 1

    def __post_init__(self) -> None:
        self.think_start = as_marker(self.think_start, "think_start")
        self.think_end = as_marker(self.think_end, "think_end")
        check_markers(self.think_start, self.think_end, ("think_start", "think_end"))
        self.markers = MarkerMatcher(self.think_start, self.think_end)
        self._max_delim = max(len(d) for d in self.params.delimiters)

    def scan_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Open the span if the prompt's last think marker is a start (a template's
        ``<think>``); delimiters in the prompt never count, markers split between the
        prompt's end and the output do."""
        for token in prompt_ids:
            self._fold_marker(token)

    def step(
        self,
        output_ids: Sequence[int],  # the request's output tokens before this step's
        emitted: Sequence[int],  # the tokens this step emitted (accepted drafts + bonus)
        values: Sequence[float] | None,  # the step's signals (``signals`` order) or None
    ) -> ExitCut | None:
        """Fold in new output, smooth the step's signals, and decide (module docstring).
        Pure with respect to ``emitted``: they are folded in at the next call, after the
        engine appended what it kept."""
        for token in output_ids[self.num_scanned :]:
            self._fold(token)
        self.num_scanned = len(output_ids)
        if values is not None and self.in_think and self.smoother is not None:
            self.smoothed = self.smoother.update(values)
        cut_at = self._first_delimiter(emitted)
        if cut_at is None or self.smoothed is None:
            return None
        smoothed = dict(zip(self.signals, self.smoothed, strict=True))
        if not all(self.params.passes(s, smoothed[s]) for s in self.enabled):
            return None
        cut = ExitCut(cut_at + 1, self.think_end, float(smoothed.get("remaining", 0.0)))
        self.num_exits += 1
        self.tokens_saved += cut.saved
        return cut

    def _first_delimiter(self, emitted: Sequence[int]) -> int | None:
        """Index of the first emitted token that ends a delimiter inside a span that was
        already open before this step (a span opened by this step has no signals yet); a
        marker the step completes before it (the model closed the span itself) means none.
        Looks ahead on copies: the state itself advances only in ``_fold``."""
        if not self.in_think:
            return None
        tail, markers = self.tail, self.markers.copy()
        for j, token in enumerate(emitted):
            if markers.push(token) is not None:
                return None
            tail = (tail + self.text_of(token))[-self._max_delim :]
            if tail.endswith(self.params.delimiters):
                return j
        return None

    def _fold(self, token: int) -> None:
        self._fold_marker(token)
        self.tail = (self.tail + self.text_of(token))[-self._max_delim :]

    def _fold_marker(self, token: int) -> None:
        hit = self.markers.push(token)
        if hit == self._START:
            self._open()
        elif hit == self._END:
            self.in_think = False

    def _open(self) -> None:
        self.in_think = True
        self.smoother = SMOOTHERS[self.params.smoothing](self.params)
        self.smoothed = None


@dataclass
class SpecExitStats:
    """Engine-wide SpecExit counts: requests that opted in, exits triggered, and the think
    tokens those exits saved by the head's own estimate (its remaining signal at exit)."""

    requests: int = 0
    exits: int = 0
    tokens_saved: float = 0.0

    def record(self, cut: ExitCut) -> None:
        self.exits += 1
        self.tokens_saved += cut.saved
