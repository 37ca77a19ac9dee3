"""One sequence's state as the scheduler, the model runner and the proposers see it.

*Computed tokens* are the tokens whose K/V are in the paged cache. There are no prefill or
decode phases: each step computes up to ``num_tokens - num_computed_tokens`` tokens (a
prefill chunk, or the one newest token when decoding); when a step reaches the last known
token, the token sampled from its logits is appended to the output.

*Pending tokens* exist only under async scheduling: a step sampled them but the host has
not read them yet. The next step may already compute a pending token (its id reaches the
model on the device), so the scheduler counts ``num_tokens_with_pending``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specdec.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a set lookup: it is read several times per request and
        # step, and an enum member hashes in Python.
        self.is_finished = value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    """Invariants: ``0 <= num_computed_tokens <= num_tokens_with_pending``; ``block_ids``
    holds exactly the blocks backing slots ``[0, len(block_ids) * block_size)``; block
    hashes cover only full blocks of known tokens (never a pending one)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 1  # resolved output budget (SamplingParams.max_tokens or context left)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled by the step in flight, not yet appended (0 or 1)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None  # first admitted to a step (not re-admissions)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending_tokens

    def token_id(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
