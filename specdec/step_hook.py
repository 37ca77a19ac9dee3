"""Hooks on a step's update: features that may cut a verify step's tokens after acceptance.

Every step mode ends a verify step the same way: acceptance decides each tree row's
*emitted* tokens (its accepted drafts, then the bonus token), then the step's update appends
them. A ``StepHook`` sits between the two. The engine holds a list of hooks, registered at
construction (``spec.proposer.make_step_hooks``: SpecExit's); after acceptance every step
mode hands the verify rows of the requests they follow to ``engine/hook_cuts.py``, the one
place their verdicts are applied: a hook may keep a prefix of a row's tokens and force
tokens after it (``StepCut``). The step modes themselves know no hook by name.

A hook also follows its requests' lifetimes: ``admit`` when one is added (refusing it by
raising ValueError), ``report`` into each output's metrics, ``release`` once it is gone.
This module is a leaf: the engine and the speculation packages both import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specdec.outputs import RequestMetrics
from specdec.request import Request


@dataclass(frozen=True)
class StepCut:
    """A hook's verdict on one verify row: keep the row's first ``keep`` emitted tokens
    (``0 <= keep <=`` their number), then emit ``forced``. The engine discards the tokens
    past ``keep`` and un-computes the accepted drafts among them (their K/V is stale);
    forced tokens are appended like sampled ones (stop checks apply to each) and
    computed by a later step."""

    keep: int
    forced: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.keep < 0:
            raise ValueError(f"StepCut.keep={self.keep} must be >= 0")


@dataclass(frozen=True)
class VerifiedRow:
    """One request's verify step as a hook sees it, before its tokens are appended
    (``request.output_token_ids`` holds the output up to this step)."""

    request: Request
    emitted: list[int]  # accepted drafts, then the bonus token (a previous hook's cut applied)
    # [num_signals]: the signals the proposer produced with this row's tree
    # (``DraftTree.signals``, in ``Proposer.exit_signals`` order); None: none
    signals: list[float] | None


class StepHook(Protocol):
    """What the engine calls on a hook (module docstring)."""

    def admit(self, request: Request) -> None:
        """Start following ``request`` if it asks for this hook; raise ValueError to refuse
        it (nothing kept: the engine then queues nothing)."""

    def follows(self, request: Request) -> bool:
        """Whether this hook judges ``request``'s verify steps. Only followed rows' signals
        are read back, and a followed request never joins a pipelined step as an arrival
        (``PipelinedStep.joins``)."""

    def cut(self, rows: Sequence[VerifiedRow]) -> list[StepCut | None]:
        """Called once per verify step with the rows of the requests it follows (at least
        one); per row, its cut or None (keep every token)."""

    def report(self, request: Request, metrics: RequestMetrics) -> None:
        """Fill what this hook counts for ``request`` into an output's ``metrics``."""

    def release(self, request_id: str) -> None:
        """Forget the request (finished, aborted, or refused by another hook); a no-op
        for one it does not follow."""
