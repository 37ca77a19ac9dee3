"""The engine's side of SpecExit: resolving a request's settings against the served model
and the draft head, reading the signals trees carry, and counting exits.

``SpecExitRuntime`` exists only when the proposer's trees carry exit signals (an EAGLE-3
head with SpecExit channels). The policy itself is ``specdec.spec.spec_exit``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from specdec.spec.spec_exit import ExitCut, SpecExitState, SpecExitStats
from specdec.spec.tree import DraftTree
from specdec.spec_exit_params import SpecExitParams
from specdec.think_markers import Marker, context_mismatch, resolve_marker

logger = logging.getLogger(__name__)
_MAX_CACHED_MARKERS = 64


class SpecExitRuntime:
    """Per engine: the tokenizer (think markers resolved to ids and token texts, both
    cached), the head's signal names, its recorded setting (``head_defaults``, the lowest
    layer of every request's settings; None: none) and ``stats``."""

    def __init__(
        self,
        tokenizer,
        signals: tuple[str, ...],
        head_defaults: dict[str, Any] | None = None,
    ) -> None:
        if not signals:
            raise ValueError("SpecExitRuntime needs a proposer whose trees carry exit signals")
        self.tokenizer = tokenizer
        self.signals = signals
        self.head_defaults = head_defaults
        self.stats = SpecExitStats()
        self._texts: dict[int, str] = {}
        self._markers: dict[tuple[str, str | Marker], Marker] = {}

    def start(self, params: SpecExitParams, prompt_ids: Sequence[int]) -> SpecExitState:
        """A request's state; raises ValueError (the request is refused) when no enabled
        signal remains or a think marker does not resolve to ids of this model
        (``think_markers.resolve_marker``)."""
        enabled = params.enabled(self.signals)
        if not enabled:
            raise ValueError(
                f"spec_exit thresholds none of the signals this draft head predicts "
                f"({', '.join(self.signals)}); set a threshold for one of them"
            )
        state = SpecExitState(
            params,
            self.signals,
            enabled,
            self.marker("think_start", params.think_start),
            self.marker("think_end", params.think_end),
            self.text_of,
        )
        state.scan_prompt(prompt_ids)
        self.stats.requests += 1
        return state

    def marker(self, name: str, value: str | Marker) -> Marker:
        """The marker's ids in this model's vocabulary, resolved once per setting."""
        key = (name, value)
        marker = self._markers.get(key)
        if marker is None:
            marker = resolve_marker(self.tokenizer, value, f"spec_exit.{name}")
            if len(self._markers) >= _MAX_CACHED_MARKERS:  # settings come from clients
                self._markers.clear()
            if isinstance(value, str) and (other := context_mismatch(self.tokenizer, value)):
                logger.warning(
                    "spec_exit.%s=%r is %s on its own but %s after a newline; it is matched "
                    "as %s: if the model writes it after a newline, give those ids instead",
                    name, value, list(marker), list(other), list(marker),
                )  # fmt: skip
            self._markers[key] = marker
        return marker

    def judge(
        self,
        state: SpecExitState,  # the opted-in request's
        output_token_ids: Sequence[int],  # its output before this step's tokens
        emitted: list[int],  # the step's tokens, bonus included
        values: list[float] | None,  # the step's tree's exit signals
    ) -> ExitCut | None:
        """The SpecExit policy's verdict on one step (None: keep every token), counted
        when it cuts: what to keep of ``emitted`` and which marker tokens to force."""
        cut = state.step(output_token_ids, emitted, values)
        if cut is not None:
            self.stats.record(cut)
        return cut

    def text_of(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    @staticmethod
    def read_signals(trees: Sequence[DraftTree]) -> list[list[float] | None]:
        """Each tree's exit signals on the host (one device-to-host copy for all; None for
        a tree without them, e.g. a root-only tree)."""
        rows = [i for i, t in enumerate(trees) if t.exit_signals is not None]
        out: list[list[float] | None] = [None] * len(trees)
        if rows:
            values = torch.stack([trees[i].exit_signals for i in rows]).tolist()
            for i, v in zip(rows, values, strict=True):
                out[i] = v
        return out
