"""Fresh input norms of a continued head, calibrated so that it starts as the head it continues.

An EAGLE-3 head continued as EAGLE-3.1 gains an RMSNorm on each fused aux state before
``fc`` (``fc_norm``); one continued with speculators' ``norm_before_fc`` gains one on their
concatenation (``input_norm``). At weight 1 such a norm hands ``fc`` rows of RMS 1 where
the head was trained on the target's raw states, whose RMS is far from 1, so the
continued head's first drafts are not the ones it was trained to make and training starts
by relearning them. Calibrated, each fresh norm's weight is the median RMS of the rows it
normalises (over a batch of the run's own data): a row of that RMS passes unchanged and
every other row is rescaled to it, so ``fc`` reads what it was trained on, up to each
row's scale, and the continued head starts where the original stands.

Invariant: only fresh norms change; ``input_norm`` is calibrated before ``fc_norm``, which
then sees its output, as ``Eagle3Head.fuse`` applies them.
"""

from __future__ import annotations

import torch

__all__ = ["calibrate_fresh_norms", "median_rms"]


def median_rms(rows: torch.Tensor) -> float:  # rows: [n, dim]
    """The median over rows of each row's root mean square, in float32."""
    return torch.sqrt(rows.float().square().mean(dim=-1)).median().item()


@torch.no_grad()
def calibrate_fresh_norms(
    head,
    fresh: tuple[str, ...],  # prefixes of the fresh norms: "input_norm.", "fc_norm."
    aux_hidden: torch.Tensor,  # [n, 3 * hidden]: fused aux states from the run's data
) -> dict[str, float]:
    """Set each fresh norm's weight to the median RMS of its input rows (module
    docstring); returns the weight each norm got, by module name."""
    weights: dict[str, float] = {}
    states = aux_hidden.to(head.fc.weight.device, torch.float32)
    if head.input_norm is not None:
        if "input_norm." in fresh:
            weights["input_norm"] = median_rms(states)
            head.input_norm.weight.fill_(weights["input_norm"])
        states = head.input_norm(states)
    if head.fc_norm is not None and "fc_norm." in fresh:
        chunks = states.chunk(len(head.fc_norm), dim=-1)  # 3 x [n, hidden]
        for i, (norm, chunk) in enumerate(zip(head.fc_norm, chunks, strict=True)):
            weights[f"fc_norm.{i}"] = median_rms(chunk)
            norm.weight.fill_(weights[f"fc_norm.{i}"])
    return weights
