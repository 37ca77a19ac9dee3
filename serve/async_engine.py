"""``AsyncLLMEngine``: the API side of the engine core, one output stream per request.

The engine core (``engine_core.py``) runs in its own process (or on a thread, see
``core_client.py``) and sends one message per step with every request's new token ids.
This side, on the event loop, turns them into OpenAI-shaped outputs: it detokenizes,
matches stop strings (then aborts the request in the core), and hands each request's
stream what is new. Streams coalesce: a stream whose reader is still busy with the last
output gets everything that arrived since in one output, so the work here grows with
how fast clients read, not with how fast the engine steps.

Lifecycle of a request: ``add_request`` checks admission, sends an *add* and awaits the
core's verdict, so a bad prompt raises ``ValueError`` before any response starts. Outputs
then arrive on its ``RequestStream``, cumulative, the last one finished. Closing a stream
early (client gone, task cancelled) sends an *abort*, which the core applies before its
next step: the request's KV blocks are free before any more work is scheduled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenDelta,
    TokenLogprobs,
)
from specdec.sampling_params import SamplingParams
from specdec.serve.core_client import InprocCoreClient
from specdec.serve.engine_core import EngineInfo, EngineSnapshot

__all__ = [
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineSnapshot",
    "QueueFullError",
    "RequestStats",
    "RequestStream",
]


class QueueFullError(RuntimeError):
    """Too many requests in flight; the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or an internal error); nothing more is served."""


@dataclass
class RequestStats:
    """One request's timeline as the server saw it (``time.monotonic`` seconds)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    core: RequestMetrics | None = None  # the engine core's timeline, once it finished it


class RequestStream:
    """Outputs of one request, the last one finished; iterate it once.

    Outputs are cumulative (``outputs[0].token_ids`` holds every token so far) and carry
    the text new since the previous output in ``text_delta``. Invariant: the deltas joined
    equal the final ``text``, which is the output's tokens decoded, cut at a matched stop
    string. ``close()`` aborts an unfinished request; leaving the iteration early (break,
    cancellation, an exception) closes it too.
    """

    def __init__(
        self,
        request_id: str,
        engine: AsyncLLMEngine,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,  # time.monotonic() when the request reached the server
    ) -> None:
        self.request_id = request_id
        self.stats = RequestStats(request_id, arrival_time, len(prompt_token_ids))
        self.done = False  # nothing more will be delivered (finished, closed or failed)
        self._engine = engine
        self._prompt_token_ids = prompt_token_ids
        self._params = params
        # Made on the first output: the prompt's ids are checked by the engine first.
        self._detokenizer: IncrementalDetokenizer | None = None
        self._token_ids: list[int] = []  # every token the core sent
        self._logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self._num_used = 0  # tokens detokenized into the output
        self._finish_reason: str | None = None  # the core's, once it finished the request
        self._stop_reason: int | str | None = None
        self._metrics: RequestMetrics | None = None
        self._error: BaseException | None = None
        self._wake = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._error is not None:
                    raise self._error
                out = self._collect()
                if out is not None:
                    yield out
                    if out.finished:
                        return
                elif self.done:  # closed elsewhere
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        self._engine._abort(self)

    # ---- event loop, from the core's messages --------------------------------------------
    def _receive(self, output: TokenDelta, now: float) -> None:
        if output.token_ids and self.stats.first_token_time is None:
            self.stats.first_token_time = now
        self._token_ids += output.token_ids
        if self._logprobs is not None and output.logprobs:
            self._logprobs += output.logprobs
        if output.finish_reason is not None:
            self._finish_reason = output.finish_reason
            self._stop_reason = output.stop_reason
            self._metrics = output.metrics
        self._wake.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()

    def _collect(self) -> RequestOutput | None:
        """What arrived since the last output, as one cumulative output (None: nothing new).
        Detokenizes the new tokens; a matched stop string finishes the request here."""
        detok = self._detokenizer
        if detok is None:
            detok = self._detokenizer = IncrementalDetokenizer(
                self._engine.tokenizer, self._prompt_token_ids, self._params
            )
        new = self._token_ids[self._num_used :]
        delta = ""
        finish, stop_reason = self._finish_reason, self._stop_reason
        if new:
            update = detok.append(new)
            delta = update.text_delta
            self._num_used += update.num_tokens_used
            if update.stop_reason is not None:
                finish, stop_reason = "stop", update.stop_reason
        if finish is not None and detok.stop_reason is None:
            delta += detok.flush()
        if not new and finish is None:
            return None
        n = self._num_used
        completion = CompletionOutput(
            index=0,
            text=detok.text,
            token_ids=self._token_ids[:n],
            finish_reason=finish,
            stop_reason=stop_reason,
            logprobs=self._logprobs[:n] if self._logprobs is not None else None,
        )
        metrics = self._metrics or RequestMetrics(arrival_time=self.stats.arrival_time)
        output = RequestOutput(
            request_id=self.request_id,
            prompt=None,
            prompt_token_ids=self._prompt_token_ids,
            outputs=[completion],
            finished=finish is not None,
            metrics=metrics,
            text_delta=delta,
        )
        self.stats.num_output_tokens = n
        if finish is not None:
            self._engine._finish(self, finish)
            if self._finish_reason is None:  # a stop string: the core is still generating
                self._engine._core.send(("abort", self.request_id))
        return output


class AsyncLLMEngine:
    """Serves an engine core to asyncio handlers (module docstring).

    ``core`` is a ``ProcCoreClient`` / ``InprocCoreClient``, or an engine object (run on a
    thread here). ``tokenizer`` detokenizes outputs (default: the engine's model's).
    """

    def __init__(self, core: Any, max_in_flight: int, tokenizer: Any = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        if not hasattr(core, "send"):  # an engine object
            core = InprocCoreClient(core)
        self._core = core
        self.info: EngineInfo = core.info
        if tokenizer is None:
            from specdec.models import load_tokenizer

            tokenizer = load_tokenizer(self.info.model)
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.snapshot = EngineSnapshot()
        self.dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, RequestStream] = {}
        self._adding: dict[str, asyncio.Future[None]] = {}
        self._finish_listeners: list[Callable[[RequestStats], None]] = []

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start delivering the core's outputs; call from the event loop that serves."""
        if self._loop is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._core.start(self._loop, self._on_message)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core after its current step; fail requests still in flight."""
        self._core.shutdown(timeout)
        error = EngineDeadError("the server is shutting down")
        self.dead = self.dead or error
        self._fail_all(error)

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def add_finish_listener(self, listener: Callable[[RequestStats], None]) -> None:
        """Call ``listener(stats)`` on the event loop when a request finishes or aborts."""
        self._finish_listeners.append(listener)

    # ---- requests -----------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it. ``arrival_time``: when
        the request reached the server (``time.monotonic()``; default: now), the start of
        its latencies.

        Raises ``QueueFullError`` when ``max_in_flight`` requests are in flight,
        ``EngineDeadError`` when the engine loop has stopped, and ``ValueError`` (the
        engine's message, e.g. prompt + max_tokens over the context) on bad input.
        """
        if self.dead is not None or self._loop is None:
            raise EngineDeadError("the engine is not running")
        if len(self._live) >= self.max_in_flight:
            raise QueueFullError(
                f"{len(self._live)} requests are in flight, the most this server queues "
                f"(max_num_seqs + max_waiting_requests = {self.max_in_flight}); retry later"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, self, prompt_token_ids, params, arrival)
        self._live[request_id] = stream
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._adding[request_id] = accepted
        self._core.send(("add", request_id, prompt_token_ids, params, time.monotonic()))
        try:
            await accepted
        except asyncio.CancelledError:
            # The add may still land; the abort sent behind it undoes it.
            self._abort(stream)
            raise
        except BaseException:
            self._finish(stream, "error")  # rejected: the engine holds nothing of it
            raise
        finally:
            self._adding.pop(request_id, None)
        return stream

    def _abort(self, stream: RequestStream) -> None:
        if stream.done:
            return
        self._finish(stream, "abort")
        stream._wake.set()  # a reader waiting on it ends
        self._core.send(("abort", stream.request_id))

    def _finish(self, stream: RequestStream, reason: str) -> None:
        if stream.done:
            return
        stream.done = True
        self._live.pop(stream.request_id, None)
        stats = stream.stats
        stats.finished_time = time.monotonic()
        stats.finish_reason = reason
        stats.core = stream._metrics
        if reason != "error":
            for listener in self._finish_listeners:
                listener(stats)

    # ---- the core's messages (event loop) -----------------------------------------------
    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, snapshot = message
            now = time.monotonic()
            live = self._live
            for output in outputs:
                stream = live.get(output[0])
                if stream is not None:  # else closed while the output was on its way
                    stream._receive(output, now)
            if snapshot is not None:
                self.snapshot = snapshot
        elif kind == "added":
            for request_id, error in message[1]:
                future = self._adding.get(request_id)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(ValueError(error))
        elif kind == "dead":
            self._on_dead(RuntimeError(message[1]))

    def _fail_all(self, error: BaseException) -> None:
        for future in self._adding.values():
            if not future.done():
                future.set_exception(error)
        for stream in list(self._live.values()):
            stream._fail(error)
            self._finish(stream, "error")

    def _on_dead(self, error: BaseException) -> None:
        self.dead = error
        self._fail_all(EngineDeadError(f"the engine stopped: {error}"))
