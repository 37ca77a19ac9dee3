"""SpecExit settings: what a request (or a server, or a draft head's record) asks of the
early-exit policy, and the smoothers those settings name.

``SpecExitParams`` is request-level metadata: ``SamplingParams.spec_exit`` holds one and
``Eagle3Config.spec_exit_defaults`` is checked against it, so it sits below both the
engine and speculation. The policy that applies it step by step (``SpecExitState``) is
``specdec.spec.spec_exit``; docs/spec_exit.md describes both.

A signal passes its threshold as ``THRESHOLDS`` says; smoothing over steps picks a
``SMOOTHERS`` entry by name. Settings are layered in one place (``spec_exit_params``) and
partial settings made canonical in another (``spec_exit_fields``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from specdec.think_markers import as_marker


@dataclass(frozen=True)
class Threshold:
    """How a signal passes: ``compare(smoothed, limit)`` with the limit in ``param``."""

    param: str  # the SpecExitParams field holding the limit (None disables the signal)
    compare: Callable[[float, float], bool]


THRESHOLDS: dict[str, Threshold] = {
    "confidence": Threshold("confidence_above", operator.gt),
    "progress": Threshold("progress_above", operator.gt),
    "remaining": Threshold("remaining_below", operator.lt),
}


@dataclass(frozen=True)
class SpecExitParams:
    """One request's SpecExit settings (per-request opt-in; the server has defaults).

    A signal is *enabled* when its threshold is set and the draft head predicts it; every
    enabled signal must pass. ``smoothing`` picks a ``SMOOTHERS`` entry: ``ewma`` (weight
    ``alpha`` on the newest step), ``momentum`` (bias-corrected moving average with decay
    ``beta``) or ``window`` (mean of the last ``window`` steps). ``think_start`` and
    ``think_end`` are text (resolved with the served model's tokenizer, any number of
    tokens) or token ids (a tuple; a JSON list is accepted), see ``think_markers``; a token
    whose text ends one of ``delimiters`` (joined with the tokens before it) ends a step.
    """

    confidence_above: float | None = 0.8  # probability, in [0, 1]
    progress_above: float | None = 0.3  # fraction of the span, in [0, 1]
    remaining_below: float | None = 200.0  # thinking tokens still to come
    smoothing: str = "ewma"
    alpha: float = 0.1
    beta: float = 0.9
    window: int = 8
    think_start: str | tuple[int, ...] = "<think>"
    think_end: str | tuple[int, ...] = "</think>"
    delimiters: tuple[str, ...] = ("\n\n",)

    _UNIT_RANGE: ClassVar[tuple[str, ...]] = ("confidence_above", "progress_above")

    def __post_init__(self) -> None:
        object.__setattr__(self, "delimiters", tuple(self.delimiters))
        limits = {t.param: getattr(self, t.param) for t in THRESHOLDS.values()}
        for name, value in limits.items():
            if value is None:
                continue
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"spec_exit.{name}={value!r} must be a finite number or null")
            if name in self._UNIT_RANGE and not 0 <= value <= 1:
                raise ValueError(f"spec_exit.{name}={value} must be in [0, 1] (or null)")
            if value < 0:
                raise ValueError(f"spec_exit.{name}={value} must be >= 0 (or null)")
        if all(v is None for v in limits.values()):
            raise ValueError(
                f"spec_exit sets no threshold ({', '.join(limits)} are all null); set one, "
                "or leave spec_exit out to never exit early"
            )
        if self.smoothing not in SMOOTHERS:
            raise ValueError(
                f"spec_exit.smoothing={self.smoothing!r}; choose one of {' | '.join(SMOOTHERS)}"
            )
        if not 0 < self.alpha <= 1:
            raise ValueError(f"spec_exit.alpha={self.alpha} must be in (0, 1]")
        if not 0 <= self.beta < 1:
            raise ValueError(f"spec_exit.beta={self.beta} must be in [0, 1)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"spec_exit.window={self.window!r} must be an int >= 1 (steps)")
        for name in ("think_start", "think_end"):
            value = getattr(self, name)
            if isinstance(value, str):
                if not value:
                    raise ValueError(f"spec_exit.{name} is empty; give its text or token ids")
            else:  # ids: a tuple, so the params stay hashable and compare by value
                object.__setattr__(self, name, as_marker(value, f"spec_exit.{name}"))
        if self.think_start == self.think_end:
            raise ValueError(f"spec_exit.think_start and think_end are both {self.think_end!r}")
        if not self.delimiters or not all(isinstance(d, str) and d for d in self.delimiters):
            raise ValueError(
                f"spec_exit.delimiters={list(self.delimiters)!r} must hold one or more "
                'non-empty strings, e.g. ["\\n\\n"]'
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: SpecExitParams | None = None) -> SpecExitParams:
        """``base`` (default: the defaults) with the keys of ``data`` replaced; unknown
        keys are errors naming the known ones."""
        if not isinstance(data, dict):
            raise ValueError(f"spec_exit must be a mapping of settings, got {data!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown spec_exit keys {unknown}; known: {known}")
        return dataclasses.replace(base or cls(), **data)

    def enabled(self, predicted: Sequence[str]) -> tuple[str, ...]:
        """Signals of ``predicted`` (the head's) that have a threshold here."""
        return tuple(s for s in predicted if getattr(self, THRESHOLDS[s].param) is not None)

    def passes(self, signal: str, value: float) -> bool:
        threshold = THRESHOLDS[signal]
        return threshold.compare(value, getattr(self, threshold.param))


def spec_exit_fields(data: Any) -> dict[str, Any]:
    """A partial SpecExit setting (some ``SpecExitParams`` fields), checked and made
    canonical: the fields must be known and valid on top of the defaults; they come back in
    field order with JSON values (lists, not tuples), so a setting round-trips through
    config.json and YAML unchanged."""
    try:
        SpecExitParams.from_dict(data)
    except TypeError as e:  # a value of the wrong type, e.g. alpha="0.1"
        raise ValueError(f"a spec_exit value has the wrong type ({e})") from None
    return {
        f.name: list(data[f.name]) if isinstance(data[f.name], tuple) else data[f.name]
        for f in fields(SpecExitParams)
        if f.name in data
    }


def spec_exit_params(*layers: dict[str, Any] | None) -> SpecExitParams:
    """The one place SpecExit settings are layered: partial settings (``SpecExitParams``
    fields), lowest precedence first, over the library defaults. Everywhere the order is:
    the draft head's record (``Eagle3Config.spec_exit_defaults``), then the server's or the
    command's settings, then the request's own fields; a later layer's field replaces an
    earlier one's, and None or {} adds nothing. The merge is validated once, so a layer may
    change related fields together (both think markers, say)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer is not None and not isinstance(layer, dict):
            raise ValueError(f"spec_exit must be a mapping of settings, got {layer!r}")
        merged.update(layer or {})
    return SpecExitParams.from_dict(merged)


# ---------------------------------------------------------------- smoothing


class Smoother(ABC):
    """Per-signal smoothing over steps; ``update`` takes one step's values and returns the
    smoothed ones (same order)."""

    def __init__(self, params: SpecExitParams) -> None:
        self.params = params

    @abstractmethod
    def update(self, values: Sequence[float]) -> list[float]: ...


class EWMA(Smoother):
    """s_1 = x_1; s_t = alpha * x_t + (1 - alpha) * s_{t-1}."""

    def __init__(self, params: SpecExitParams) -> None:
        super().__init__(params)
        self.value: list[float] | None = None

    def update(self, values: Sequence[float]) -> list[float]:
        a = self.params.alpha
        prev = self.value
        self.value = list(values) if prev is None else [
            a * x + (1 - a) * s for x, s in zip(values, prev, strict=True)
        ]  # fmt: skip
        return self.value


class Momentum(Smoother):
    """m_t = beta * m_{t-1} + (1 - beta) * x_t from m_0 = 0, reported as m_t / (1 -
    beta^t) (bias-corrected, as Adam's first moment): no seed value dominates early."""

    def __init__(self, params: SpecExitParams) -> None:
        super().__init__(params)
        self.moment: list[float] | None = None
        self.steps = 0

    def update(self, values: Sequence[float]) -> list[float]:
        b = self.params.beta
        prev = self.moment or [0.0] * len(values)
        self.moment = [b * m + (1 - b) * x for x, m in zip(values, prev, strict=True)]
        self.steps += 1
        return [m / (1 - b**self.steps) for m in self.moment]


class WindowMean(Smoother):
    """Mean of the last ``window`` steps (fewer before that many)."""

    def __init__(self, params: SpecExitParams) -> None:
        super().__init__(params)
        self.recent: deque[list[float]] = deque(maxlen=params.window)

    def update(self, values: Sequence[float]) -> list[float]:
        self.recent.append(list(values))
        return [sum(col) / len(self.recent) for col in zip(*self.recent, strict=True)]


SMOOTHERS: dict[str, type[Smoother]] = {"ewma": EWMA, "momentum": Momentum, "window": WindowMean}
