"""The ways one engine step runs, behind one interface.

Every step has the same shape: the scheduler picks each request's tokens, the runner
computes them (and the proposer drafts, the target verifies), and the outcome updates the
requests (the step hooks' cuts of verify rows, ``hook_cuts.py``; tokens appended,
computed-token counts advanced or rolled back to what acceptance and the cuts kept,
stops, frees). The modes differ in when the host reads the outcome:

- ``SyncStep`` reads it before returning (every step can do this: plain and speculative,
  sampled or greedy, prefill chunks, a step hook's forced tokens);
- ``AsyncStep`` launches step N+1 before reading step N (plain steps above the
  speculation bands, and every step of an engine without a proposer);
- ``PipelinedStep`` does the same for speculative steps of greedy requests, drafting
  step N+1 from step N's device outcome (an EAGLE-3 head, a block drafter).

``LLMEngine.step`` asks the modes in that order of preference (pipelined, async, sync)
whether they can run the next step; before one runs, any other mode's step still in
flight is read (``drain``), since no two modes' steps may be in flight at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from specdec.outputs import RequestOutput, TokenDelta

if TYPE_CHECKING:
    from specdec.engine.llm_engine import LLMEngine

StepOutputs = list[RequestOutput | TokenDelta]


class StepMode(ABC):
    """One way of running a step; holds what it launched and has not read yet."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @abstractmethod
    def can_run(self) -> bool:
        """Whether this mode can run the engine's next step."""

    @abstractmethod
    def step(self, deferring: bool) -> StepOutputs:
        """Run one step and return the outputs read in it. ``deferring``: the previous
        step left its aux states in the runner's cache (``LLMEngine.defer_observation``)."""

    @property
    def in_flight(self) -> bool:
        """Whether a step of this mode was launched and not read."""
        return False

    def drain(self) -> StepOutputs:
        """Read whatever this mode has in flight; its outputs."""
        return []
