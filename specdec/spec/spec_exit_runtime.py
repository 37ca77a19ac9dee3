"""The engine's side of SpecExit: a step hook (specdec/step_hook.py) that resolves an
opted-in request's settings against the served model and the draft head, judges each of
its verify steps by the signals the step's tree carries, and counts exits.

``SpecExitRuntime`` is registered only when the proposer's trees carry exit signals (an
EAGLE-3 head with SpecExit channels); elsewhere ``SpecExitUnavailable`` stands in its place
and refuses the requests that opt in (``proposer.make_step_hooks``). The policy itself is
``specdec.spec.spec_exit``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from specdec.outputs import RequestMetrics
from specdec.request import Request
from specdec.spec.spec_exit import SpecExitState, SpecExitStats
from specdec.spec_exit_params import SpecExitParams
from specdec.step_hook import StepCut, VerifiedRow
from specdec.think_markers import Marker, context_mismatch, resolve_marker

logger = logging.getLogger(__name__)
_MAX_CACHED_MARKERS = 64


class SpecExitRuntime:
    """Per engine: the tokenizer (think markers resolved to ids and token texts, both
    cached), the head's signal names, its recorded setting (``head_defaults``, the lowest
    layer of every request's settings; None: none), ``stats``, and the state of every
    live request that opted in (a ``StepHook``: admitted to released)."""

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
        self._states: dict[str, SpecExitState] = {}  # by request id

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

    # ---- the step hook (specdec/step_hook.py) ------------------------------------------
    def admit(self, request: Request) -> None:
        """Follow a request that opted in (``SamplingParams.spec_exit``); ``start``'s
        ValueError refuses it."""
        params = request.sampling_params.spec_exit
        if params is not None:
            self._states[request.request_id] = self.start(params, request.prompt_token_ids)

    def follows(self, request: Request) -> bool:
        return request.request_id in self._states

    def cut(self, rows: Sequence[VerifiedRow]) -> list[StepCut | None]:
        """The SpecExit policy's verdict on each row's step (``SpecExitState.step``),
        counted when it exits: keep the tokens through the delimiter, force the think-end
        marker."""
        cuts: list[StepCut | None] = []
        for row in rows:
            state = self._states[row.request.request_id]
            exit_cut = state.step(row.request.output_token_ids, row.emitted, row.signals)
            if exit_cut is None:
                cuts.append(None)
                continue
            self.stats.record(exit_cut)
            cuts.append(StepCut(exit_cut.keep, exit_cut.tokens))
        return cuts

    def report(self, request: Request, metrics: RequestMetrics) -> None:
        """A request that opted in reports its exits and the think tokens they saved."""
        state = self._states.get(request.request_id)
        if state is not None:
            metrics.spec_exits = state.num_exits
            metrics.spec_exit_tokens_saved = state.tokens_saved

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def text_of(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


class SpecExitUnavailable:
    """SpecExit's step hook where the proposer's trees carry no exit signals (no EAGLE-3
    head with SpecExit channels, or speculation off): it refuses every request that opts
    in and follows none."""

    def admit(self, request: Request) -> None:
        if request.sampling_params.spec_exit is not None:
            raise ValueError(
                "spec_exit needs an EAGLE-3 draft head with SpecExit channels; this "
                "engine's speculation has none (leave spec_exit out)"
            )

    def follows(self, request: Request) -> bool:
        return False

    def cut(self, rows: Sequence[VerifiedRow]) -> list[StepCut | None]:
        return [None] * len(rows)

    def report(self, request: Request, metrics: RequestMetrics) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass
