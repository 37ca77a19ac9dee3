"""``AsyncLLMEngine``: the engine loop on a background thread, one output stream per request.

Threading contract. ``LLMEngine`` is not thread-safe, so only the engine thread calls it
(add_request, abort_request, step, and the reads behind ``snapshot``). The event loop talks
to it through an inbox of commands guarded by a ``threading.Condition``, and the engine
thread answers through ``loop.call_soon_threadsafe``. Streams, the in-flight count and the
finish listeners live on the event loop thread only. With nothing queued or running the
engine thread sleeps on the condition: an idle server burns no CPU.

Lifecycle of a request: ``add_request`` (event loop) checks admission, queues an *add* and
awaits the engine's verdict, so a bad prompt raises ``ValueError`` before any response
starts. Outputs then arrive on the request's ``RequestStream`` in engine order, the last
one finished. Closing a stream early (client gone, task cancelled) queues an *abort*,
which the engine thread applies before its next step: the request's KV blocks are free
before any more work is scheduled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from specdec.engine.llm_engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests in flight; the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or an internal error); nothing more is served."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state after the engine thread's latest iteration (what /metrics reports).
    Counters are cumulative since start; blocks exclude the null block."""

    num_running: int = 0
    num_waiting: int = 0
    kv_total_blocks: int = 0
    kv_free_blocks: int = 0
    prefix_cache_queries: int = 0  # blocks looked up in the prefix cache
    prefix_cache_hits: int = 0  # blocks found there
    num_steps: int = 0
    num_preemptions: int = 0
    spec_depth: int = 0  # draft positions (0 without speculation)
    spec_steps: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_at_least: tuple[int, ...] = ()  # [k-1]: steps accepting >= k tokens
    spec_exit_requests: int = 0  # requests that opted into SpecExit
    spec_exit_exits: int = 0  # thinking cut short
    spec_exit_tokens_saved: float = 0.0  # the head's remaining-tokens estimate at exits

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks held by requests (0.0 .. 1.0)."""
        if not self.kv_total_blocks:
            return 0.0
        return 1.0 - self.kv_free_blocks / self.kv_total_blocks


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


class RequestStream:
    """Outputs of one request, in engine order, the last one finished; iterate it once.

    Outputs are cumulative (``outputs[0].token_ids`` holds every token so far) and carry
    the new text in ``text_delta``. ``close()`` aborts an unfinished request; leaving the
    iteration early (break, cancellation, an exception) closes it too.
    """

    def __init__(self, request_id: str, engine: AsyncLLMEngine, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.stats = RequestStats(request_id, time.monotonic(), num_prompt_tokens)
        self.done = False  # nothing more will be delivered (finished, closed or failed)
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        self._engine._abort(self)


class AsyncLLMEngine:
    """Drives an ``LLMEngine`` from a background thread for an asyncio server."""

    def __init__(self, engine: LLMEngine, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.snapshot = EngineSnapshot()
        self.dead: BaseException | None = None
        # Engine-thread side (guarded by _cond).
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Event-loop side.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, RequestStream] = {}
        self._finish_listeners: list[Callable[[RequestStats], None]] = []

    # ---- lifecycle (event loop) ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will add requests."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self.snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; fail requests still in flight."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        error = EngineDeadError("the server is shutting down")
        self.dead = self.dead or error
        self._fail_all(error)

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def add_finish_listener(self, listener: Callable[[RequestStats], None]) -> None:
        """Call ``listener(stats)`` on the event loop when a request finishes or aborts."""
        self._finish_listeners.append(listener)

    # ---- requests (event loop) ----------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it.

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
        # Cumulative outputs: the final one holds every token id and logprob (usage and
        # non-streaming bodies need them); streams send ``text_delta`` and slice logprobs.
        params = replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        stream = RequestStream(request_id, self, len(prompt_token_ids))
        self._live[request_id] = stream
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._submit("add", (request_id, prompt_token_ids, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            # The add may still land; the abort queued behind it undoes it.
            self._abort(stream)
            raise
        except BaseException:
            self._finish(stream, "error")  # rejected: the engine holds nothing of it
            raise
        return stream

    def _abort(self, stream: RequestStream) -> None:
        if stream.done:
            return
        self._finish(stream, "abort")
        self._submit("abort", stream.request_id)

    def _finish(self, stream: RequestStream, reason: str) -> None:
        if stream.done:
            return
        stream.done = True
        self._live.pop(stream.request_id, None)
        stats = stream.stats
        stats.finished_time = time.monotonic()
        stats.finish_reason = reason
        if reason != "error":
            for listener in self._finish_listeners:
                listener(stats)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One engine step's outputs, on the event loop."""
        now = time.monotonic()
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:  # closed while the output was on its way
                continue
            completion = out.outputs[0]
            stats = stream.stats
            stats.num_output_tokens = len(completion.token_ids)
            if stats.first_token_time is None and completion.token_ids:
                stats.first_token_time = now
            stream._queue.put_nowait(out)
            if out.finished:
                self._finish(stream, completion.finish_reason or "stop")

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._live.values()):
            stream._queue.put_nowait(error)
            self._finish(stream, "error")

    def _on_dead(self, error: BaseException) -> None:
        self.dead = error
        self._fail_all(EngineDeadError(f"the engine stopped: {type(error).__name__}"))

    # ---- the engine thread --------------------------------------------------------------
    def _submit(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed during shutdown
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
        except BaseException as e:
            logger.exception("the engine loop failed; the server cannot generate any more")
            self._post(self._on_dead, e)

    def _iteration(self) -> bool:
        """Apply queued commands, then run one step if any request is unfinished.
        Returns False once shutdown was asked for."""
        engine = self.engine
        with self._cond:
            while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return False
            commands, self._inbox = self._inbox, []
        for kind, payload in commands:
            if kind == "add":
                self._apply_add(*payload)
            else:
                engine.abort_request(payload)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        self.snapshot = self._take_snapshot()
        if outputs:
            self._post(self._deliver, outputs)
        return True

    def _apply_add(
        self, request_id: str, prompt: list[int], params: SamplingParams, accepted: asyncio.Future
    ) -> None:
        error: BaseException | None = None
        try:
            self.engine.add_request(prompt, params, request_id)
        except (ValueError, TypeError) as e:  # bad input: the engine state is unchanged
            error = ValueError(str(e))
        self._post(_resolve, accepted, error)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        pool = engine.kv_manager.pool
        spec = engine.spec_stats
        exits = engine.spec_exit.stats if engine.spec_exit is not None else None
        return EngineSnapshot(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            kv_total_blocks=pool.num_usable_blocks,
            kv_free_blocks=pool.num_free_blocks,
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            num_steps=engine.num_steps,
            num_preemptions=engine.scheduler.num_preemptions,
            spec_depth=engine.proposer.max_depth if engine.proposer is not None else 0,
            spec_steps=spec.steps,
            spec_drafted_tokens=spec.drafted_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_at_least=tuple(spec.accepted_at_least),
            spec_exit_requests=exits.requests if exits else 0,
            spec_exit_exits=exits.exits if exits else 0,
            spec_exit_tokens_saved=exits.tokens_saved if exits else 0.0,
        )


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiting request was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
