"""Per-request sampling parameters: how one request turns logits into tokens, and when it stops.

The order in which the random-sampling filters apply is defined once here and followed by
``specdec.sampling.sampler`` (and so by lossless rejection sampling, which reuses it):
temperature scaling, then top-k, then top-p on the top-k-renormalised distribution, then
min-p (a ratio to the most likely token, so it does not care about renormalisation).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from specdec.spec_exit_params import SpecExitParams

# Most top logprobs a request may ask for per token (the OpenAI API's limit).
MAX_LOGPROBS = 20

# Temperatures below this sample greedily: the scaled distribution is already a point mass
# at float32 precision, and dividing logits by a tinier number overflows to inf (then NaN).
GREEDY_TEMPERATURE_EPS = 1e-5

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's accepted range


def _require_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a token count is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is invalid; {name} must be an int")


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` reports for a request: the whole output so far every step
    (CUMULATIVE), only what is new (DELTA, for streaming), nothing until it finishes
    (FINAL_ONLY, for offline batches: no per-step copies or text rebuilding), or only the
    new token ids as a ``TokenDelta`` tuple with no text at all (TOKENS: for a caller that
    detokenizes itself, as the server's API process does off the engine's critical path;
    stop strings need the text, so they are refused)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"
    TOKENS = "tokens"


@dataclass
class SamplingParams:
    """How to sample one request's output and when to stop it.

    After construction ``stop`` is always a ``list[str]`` (a single string or None is
    accepted and normalised), ``stop_token_ids`` a ``list[int]``, and ``top_k`` is 0 when
    disabled (-1 is accepted as a synonym).

    Stopping: the request ends at ``max_tokens`` output tokens, at the model's EOS token
    (unless ``ignore_eos``), at any id in ``stop_token_ids``, or when the output text
    contains a string from ``stop``. Neither EOS, stop token ids nor stop strings end a
    request that has fewer than ``min_tokens`` output tokens.

    ``speculate=False`` decodes the request plainly even when the engine speculates (one
    token per step; the others in the batch still speculate). Outputs are the same either
    way; it trades the request's latency for the batch's verify work.

    ``spec_exit`` opts the request into SpecExit (docs/spec_exit.md): with an EAGLE-3 head
    that has exit channels, its thinking may end early at a step boundary (the output then
    differs from plain decoding by design). None: the output is plain decoding's.
    """

    temperature: float = 1.0  # 0 (anything < GREEDY_TEMPERATURE_EPS) means greedy argmax
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = 0  # >= 1 keeps the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # in [0, 1]; keeps tokens with prob >= min_p * max prob; 0 disables
    max_tokens: int | None = 16  # None: until the context length runs out
    min_tokens: int = 0
    seed: int | None = None  # per-request RNG: same seed, same output, whatever the batch
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per output token, 0..MAX_LOGPROBS
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    speculate: bool = True
    spec_exit: SpecExitParams | None = None

    def __post_init__(self) -> None:
        self._validate_sampling()
        self._validate_lengths()
        self._normalise_stops()
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed={self.seed} is invalid; use an int in [-2**63, 2**64 - 1]")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs={self.logprobs} is invalid; use 0..{MAX_LOGPROBS} "
                    "(0 returns only the sampled token's logprob), or None for none"
                )
        if not isinstance(self.speculate, bool):
            raise TypeError(f"speculate={self.speculate!r} is invalid; pass True or False")
        if self.output_kind is RequestOutputKind.TOKENS and self.stop:
            raise ValueError(
                f"stop={self.stop!r} needs text, which output_kind=TOKENS does not make; "
                "match stop strings on the caller's side, or use another output_kind"
            )
        if self.spec_exit is not None and not isinstance(self.spec_exit, SpecExitParams):
            raise TypeError(
                f"spec_exit={self.spec_exit!r} is invalid; pass SpecExitParams(...) or None"
            )

    def _validate_sampling(self) -> None:
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ValueError(
                f"temperature={self.temperature!r} is invalid; use a finite number >= 0"
            )
        if self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature} is invalid; use temperature >= 0 (0 means greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(
                f"top_p={self.top_p} is invalid; use 0 < top_p <= 1 (1 disables top-p)"
            )
        _require_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(
                f"top_k={self.top_k} is invalid; use top_k >= 1, or 0 / -1 to disable it"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(
                f"min_p={self.min_p} is invalid; use 0 <= min_p <= 1 (0 disables min-p)"
            )

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(
                    f"max_tokens={self.max_tokens} is invalid; use max_tokens >= 1, "
                    "or None to generate until the context length is reached"
                )
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} is invalid; use min_tokens >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; "
                "lower min_tokens or raise max_tokens"
            )

    def _normalise_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(
                    f"stop contains {s!r}; every stop string must be a non-empty str "
                    "(an empty one would match at once)"
                )
        self.stop_token_ids = list(self.stop_token_ids)
        for t in self.stop_token_ids:
            _require_int("stop_token_ids entry", t)
            if t < 0:
                raise ValueError(f"stop_token_ids contains {t}; token ids are >= 0")

    @property
    def is_greedy(self) -> bool:
        """True when this request takes the argmax token (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
