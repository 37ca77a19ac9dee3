"""The step hooks' verdicts on a verify step (specdec/step_hook.py), applied the same way by
every step mode: ``cut_rows`` asks each hook about the rows it follows and returns, per
cut row, what the step now emits and how many accepted drafts keep their K/V. The step
mode then does its own bookkeeping (the synchronous step rolls the scheduler back; the
pipelined step advances it by less and drops the row's step in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.request import Request
from specdec.spec.tree import DraftTree
from specdec.step_hook import StepHook, VerifiedRow

# Reads the signals of the given rows (indices into the step's rows), in that order.
SignalReader = Callable[[list[int]], list[list[float] | None]]


@dataclass(frozen=True)
class RowCut:
    """A verify row after the hooks' cuts: ``tokens`` replace its emitted tokens (a prefix
    of them, then forced tokens), and only its first ``num_accepted`` accepted drafts
    stay computed (the rest, and every forced token, are computed by a later step)."""

    tokens: list[int]
    num_accepted: int


def cut_rows(
    hooks: Sequence[StepHook],
    requests: Sequence[Request],  # each verify row's request
    emitted: Sequence[list[int]],  # each row's accepted drafts, then the bonus token
    num_accepted: Sequence[int],  # each row's accepted drafts (K/V computed this step)
    read_signals: SignalReader,
) -> dict[int, RowCut]:
    """The rows some hook cut (by index into ``requests``). Hooks judge in order, each
    seeing the tokens the previous ones left; only followed rows' signals are read, once
    for all hooks. Without a followed row no hook is called."""
    followed = [
        [j for j, request in enumerate(requests) if hook.follows(request)] for hook in hooks
    ]
    rows = sorted({j for js in followed for j in js})
    if not rows:
        return {}
    signals = dict(zip(rows, read_signals(rows), strict=True))
    tokens = {j: emitted[j] for j in rows}
    kept = {j: num_accepted[j] for j in rows}
    cut: set[int] = set()
    for hook, js in zip(hooks, followed, strict=True):
        if not js:
            continue
        views = [VerifiedRow(requests[j], tokens[j], signals[j]) for j in js]
        for j, verdict in zip(js, hook.cut(views), strict=True):
            if verdict is None:
                continue
            if verdict.keep > len(tokens[j]):
                raise ValueError(
                    f"{type(hook).__name__} keeps {verdict.keep} tokens of a step that "
                    f"emitted {len(tokens[j])}; keep at most those"
                )
            tokens[j] = [*tokens[j][: verdict.keep], *verdict.forced]
            # Tokens past `keep` are discarded or forced: neither has K/V from this step.
            kept[j] = min(kept[j], verdict.keep)
            cut.add(j)
    return {j: RowCut(tokens[j], kept[j]) for j in sorted(cut)}


def tree_signals(trees: Sequence[DraftTree]) -> list[list[float] | None]:
    """Each tree's signals on the host, one device-to-host copy for all (None for a tree
    without them, e.g. a root-only tree)."""
    rows = [i for i, t in enumerate(trees) if t.signals is not None]
    out: list[list[float] | None] = [None] * len(trees)
    if rows:
        values = torch.stack([trees[i].signals for i in rows]).tolist()
        for i, v in zip(rows, values, strict=True):
            out[i] = v
    return out
