"""What the engine returns for a request (shaped like vLLM's outputs, so code ports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class TokenLogprobs:
    """Logprobs of one output token: the sampled token's and the top-n alternatives'."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    # time.monotonic() seconds (system-wide on Linux: a server's processes compare them).
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # first admitted to a step: queue time ends
    # Speculation (zero without it): verify steps with a draft, draft tokens, accepted ones.
    spec_steps: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    # SpecExit (None unless the request opted in): exits triggered (thinking cut short),
    # and the think tokens they saved by the draft head's estimate (its remaining signal).
    spec_exits: int | None = None
    spec_exit_tokens_saved: float | None = None

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step, bonus included (0 without speculation)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0


class TokenDelta(NamedTuple):
    """A step's report for a request of ``output_kind=TOKENS``: what is new since its last
    one, no text (a plain tuple: cheap to build every step and to pickle)."""

    request_id: str
    token_ids: list[int]  # the new output token ids
    logprobs: list[TokenLogprobs] | None  # theirs, for a request that asked
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None  # the stop token id that matched
    metrics: RequestMetrics | None  # on the finishing report only


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    text_delta: str = ""  # new text since the previous output of this request (streaming)
