"""SpecExit predictor channels: what each signal a draft head may predict means.

A head with SpecExit channels (``Eagle3Config.exit_signals``) has a linear map from the
fused aux states to one raw value per signal (``Eagle3Head.spec_exit``; the same as
widening ``fc`` by a few output rows, plus a bias). This registry says, once, how a raw
value becomes the signal the exit policy thresholds (``activation``) and in which order
signals are stored (``SIGNAL_ORDER``). Labels and losses live with the trainer
(``specdec.train.spec_exit_labels``), thresholds with the policy (``specdec.spec.spec_exit``).

Signals at a position ``t`` inside a think span (the head has read tokens up to ``t``):

- ``confidence``: probability that an answer forced now would already be settled: the
  trace's final answer (or a correct one; ``data-gen exit-labels --target``) (sigmoid; in
  [0, 1]).
- ``progress``: fraction of the span's thinking already written (sigmoid; in [0, 1]).
- ``remaining``: thinking tokens still to come before the end-of-think token (exp - 1,
  clamped at 0; raw values regress ``log1p(remaining)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _expm1_clamped(raw: torch.Tensor) -> torch.Tensor:
    return torch.expm1(raw.clamp(max=30.0)).clamp(min=0.0)  # 30: e^30 tokens is "forever"


@dataclass(frozen=True)
class ExitSignal:
    name: str
    activation: Callable[[torch.Tensor], torch.Tensor]  # raw [..] -> signal [..], elementwise
    unit: str  # what the activated value measures (docs and error messages)


EXIT_SIGNALS: dict[str, ExitSignal] = {
    s.name: s
    for s in (
        ExitSignal("confidence", torch.sigmoid, "probability"),
        ExitSignal("progress", torch.sigmoid, "fraction of the think span"),
        ExitSignal("remaining", _expm1_clamped, "tokens"),
    )
}
SIGNAL_ORDER: tuple[str, ...] = tuple(EXIT_SIGNALS)


def canonical_signals(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` validated and put in storage order (``SIGNAL_ORDER``); raises naming an
    unknown or repeated signal."""
    names = list(names)
    unknown = [n for n in names if n not in EXIT_SIGNALS]
    if unknown:
        raise ValueError(f"unknown SpecExit signal(s) {unknown}; choose from {list(SIGNAL_ORDER)}")
    if len(set(names)) != len(names):
        raise ValueError(f"SpecExit signals {names} repeat a name; list each once")
    return tuple(n for n in SIGNAL_ORDER if n in names)


def activate(
    signals: Sequence[str],
    raw: torch.Tensor,  # [..., len(signals)]: the head's raw channel outputs
) -> torch.Tensor:  # [..., len(signals)] float32: the signals' values
    """Each channel through its signal's activation (device ops only)."""
    raw = raw.float()
    return torch.stack(
        [EXIT_SIGNALS[name].activation(raw[..., j]) for j, name in enumerate(signals)], dim=-1
    )
