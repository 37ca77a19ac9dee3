"""The SpecExit term of the training objective: the head's exit channels against the labels
of ``spec_exit_labels`` (NaN = no label, skipped).

Per signal (``LOSSES``): confidence and progress are binary cross-entropy on the raw
channel (soft labels allowed), remaining is Huber (or MSE) between the raw channel and
``log1p(tokens)`` — the activation ``exp - 1`` inverts it. Each signal's loss is averaged
over its labelled positions and weighted (``weights``); the term is their sum. The
channels read the same aux states as ``fc``, so the term costs one small matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.train.ttt import PackedBatch


def _bce(raw: torch.Tensor, target: torch.Tensor, _: str) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(raw, target, reduction="none")


def _log_tokens(raw: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    goal = torch.log1p(target.clamp(min=0))
    if kind == "mse":
        return F.mse_loss(raw, goal, reduction="none")
    return F.huber_loss(raw, goal, reduction="none", delta=1.0)


# signal -> per-position loss(raw [m], target [m], remaining_loss) -> [m]
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]] = {
    "confidence": _bce,
    "progress": _bce,
    "remaining": _log_tokens,
}
REMAINING_LOSSES = ("huber", "mse")


@dataclass
class ExitLossOutput:
    """The weighted term (carries gradients) and per-signal figures (detached)."""

    loss: torch.Tensor  # scalar
    signal_losses: torch.Tensor  # [k] float32: each signal's mean over labelled positions
    signal_counts: torch.Tensor  # [k] int64: labelled positions


@dataclass(frozen=True)
class SpecExitLoss:
    """``weights[name]`` per signal of the head (a missing name weighs 1)."""

    weights: dict[str, float]
    remaining_loss: str = "huber"

    def __post_init__(self) -> None:
        if self.remaining_loss not in REMAINING_LOSSES:
            raise ValueError(
                f"remaining_loss={self.remaining_loss!r}; choose one of {REMAINING_LOSSES}"
            )

    def __call__(self, head, batch: PackedBatch) -> ExitLossOutput:
        """``head`` has exit channels; ``batch.exit_targets`` [n, k] in their order."""
        targets = batch.exit_targets
        if targets is None:
            raise ValueError("the batch has no exit_targets; give the data source a labeler")
        signals = head.config.exit_signals
        if targets.shape[1] != len(signals):
            raise ValueError(
                f"exit_targets has {targets.shape[1]} columns; the head predicts {signals}"
            )
        raw = head.exit_logits(batch.aux_hidden.to(head.spec_exit.weight.dtype)).float()
        total = raw.new_zeros(())
        losses, counts = [], []
        for j, name in enumerate(signals):
            labelled = ~torch.isnan(targets[:, j])  # [n]
            count = labelled.sum()
            target = torch.where(labelled, targets[:, j], torch.zeros_like(targets[:, j]))
            per_pos = LOSSES[name](raw[:, j], target.float(), self.remaining_loss)  # [n]
            mean = (per_pos * labelled).sum() / count.clamp(min=1)
            total = total + self.weights.get(name, 1.0) * mean
            losses.append(mean.detach())
            counts.append(count)
        return ExitLossOutput(total, torch.stack(losses), torch.stack(counts))
