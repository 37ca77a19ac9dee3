"""Engine-side request state and the outputs built from it.

``OutputProcessor`` keeps a ``RequestState`` per live request (the torch-free ``Request``
plus its detokenizer, seeded sampling stream and logprobs) and tells the engine's step
hooks (specdec/step_hook.py) when a request arrives and leaves. Every step mode
appends the tokens it emitted here (``append_token``: stop checks on EOS, stop ids, stop
strings, ``max_tokens`` and the context) and reports here (``report``: one output per
request and step, by its ``output_kind``), so a token is kept and reported the same way
whichever path computed it. A request is forgotten once its finishing output is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.engine.scheduler import Scheduler
from specdec.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenDelta,
    TokenLogprobs,
)
from specdec.request import Request, RequestStatus
from specdec.sampling.seeded_stream import SeededStream
from specdec.sampling_params import RequestOutputKind
from specdec.spec.metrics import SpecStats
from specdec.step_hook import StepHook

if TYPE_CHECKING:
    from specdec.spec.pipeline import SpecLaunch


@dataclass
class RequestState:
    """Engine-side companions of a Request (the Request itself stays torch-free)."""

    request: Request
    prompt: str | None
    # None when the text is only needed at the end (FINAL_ONLY without stop strings):
    # the output is then decoded once instead of token by token; or not at all (TOKENS).
    detokenizer: IncrementalDetokenizer | None
    stream: SeededStream | None  # seeded random requests only
    logprobs: list[TokenLogprobs] | None = None
    pending_delta: list[str] = field(default_factory=list)
    num_sent_tokens: int = 0  # output tokens already carried by a DELTA output
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # A pipelined step launched from an outcome that a step hook then cut: its row for
    # this request is stale and dropped when read.
    stale_launch: SpecLaunch | None = None


class OutputProcessor:
    """The live requests' states, token appending and output building (module docstring).
    ``release(request_id)`` is called when a request is forgotten (a proposer's
    per-request state); ``hooks`` is the engine's list of step hooks (shared: hooks added
    to it later are told too)."""

    def __init__(
        self,
        tokenizer: Callable[[], Any],  # returns the tokenizer (loaded when first needed)
        scheduler: Scheduler,
        max_model_len: int,
        release: Callable[[str], None] = lambda request_id: None,
        hooks: Sequence[StepHook] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.states: dict[str, RequestState] = {}
        self._release = release
        self.hooks = hooks

    def add(self, request: Request, text: str | None) -> None:
        """Track a new request: ``text`` is its prompt as given (None for token ids). Each
        step hook admits it first; one that refuses it raises ValueError, and nothing of
        the request is kept."""
        try:
            for hook in self.hooks:
                hook.admit(request)
        except ValueError:
            for hook in self.hooks:
                hook.release(request.request_id)
            raise
        params = request.sampling_params
        seeded = params.seed is not None and not params.is_greedy
        self.states[request.request_id] = RequestState(
            request=request,
            prompt=text,
            detokenizer=(
                IncrementalDetokenizer(self._tokenizer(), request.prompt_token_ids, params)
                if params.stop
                or params.output_kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)
                else None
            ),
            stream=SeededStream(params.seed) if seeded else None,
            logprobs=[] if params.logprobs is not None else None,
        )

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request (and the proposer's and hooks' state of it)."""
        del self.states[request_id]
        self._release(request_id)
        for hook in self.hooks:
            hook.release(request_id)

    def report(self, state: RequestState, outputs: list[RequestOutput | TokenDelta]) -> None:
        """Add the request's output if its kind reports this step; forget it once done."""
        request = state.request
        finished = request.status.is_finished
        kind = request.sampling_params.output_kind
        if kind is RequestOutputKind.TOKENS:
            outputs.append(self._token_delta(state, finished))
        elif finished or kind is not RequestOutputKind.FINAL_ONLY:
            outputs.append(self._make_output(state, delta=kind is RequestOutputKind.DELTA))
        if finished:
            self.forget(request.request_id)

    def append_token(self, state: RequestState, token_id: int, logprob, now: float) -> None:
        request = state.request
        request.output_token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        if state.logprobs is not None and logprob is not None:
            n = request.sampling_params.logprobs or 0
            state.logprobs.append(
                TokenLogprobs(
                    logprob.token_id, logprob.logprob, dict(list(logprob.top.items())[:n])
                )
            )
        stop_str = None
        if state.detokenizer is not None:
            update = state.detokenizer.append([token_id])
            state.pending_delta.append(update.text_delta)
            stop_str = update.stop_reason
        status = self._stop_status(request, token_id, stop_str)
        if status is not None:
            if state.detokenizer is not None and stop_str is None:
                # Release text held back in case it began a stop string.
                state.pending_delta.append(state.detokenizer.flush())
            self.scheduler.finish(request, status)
            request.finished_time = now

    def _stop_status(self, request: Request, token_id: int, stop_str) -> RequestStatus | None:
        params = request.sampling_params
        n_out = len(request.output_token_ids)  # per token and request: no properties
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_str is not None:
                request.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if (
            n_out >= request.max_tokens
            or len(request.prompt_token_ids) + n_out >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, state: RequestState, delta: bool = False) -> RequestOutput:
        """CUMULATIVE/FINAL_ONLY carry the whole output; DELTA the tokens (a verify step
        may emit several), logprobs and text since the previous output (``text_delta`` is
        filled in every kind)."""
        request = state.request
        finished = request.is_finished
        text_delta = "".join(state.pending_delta)
        state.pending_delta.clear()
        logprobs = state.logprobs
        if delta:
            sent, state.num_sent_tokens = state.num_sent_tokens, request.num_output_tokens
            text, token_ids = text_delta, list(request.output_token_ids[sent:])
            logprobs = logprobs[sent:] if logprobs is not None else None
        elif state.detokenizer is not None:
            text, token_ids = state.detokenizer.text, list(request.output_token_ids)
        else:
            text = self._tokenizer().decode(
                request.output_token_ids,
                skip_special_tokens=request.sampling_params.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            text_delta, token_ids = text, list(request.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            logprobs=list(logprobs) if logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=self._metrics(state),
            text_delta=text_delta,
        )

    def _token_delta(self, state: RequestState, finished: bool) -> TokenDelta:
        """TOKENS: the ids (and logprobs) since the request's last report, no text."""
        request = state.request
        sent, state.num_sent_tokens = state.num_sent_tokens, request.num_output_tokens
        return TokenDelta(
            request.request_id,
            request.output_token_ids[sent:],
            state.logprobs[sent:] if state.logprobs is not None else None,
            request.status.value if finished else None,
            request.stop_reason,
            self._metrics(state) if finished else None,
        )

    def _metrics(self, state: RequestState) -> RequestMetrics:
        request, spec = state.request, state.spec_stats
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            first_scheduled_time=request.first_scheduled_time,
            spec_steps=spec.steps,
            spec_drafted_tokens=spec.drafted_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
        )
        for hook in self.hooks:
            hook.report(request, metrics)
        return metrics
