"""Transports between the API side and the engine core (``engine_core.py``).

``ProcCoreClient`` runs the core in its own process (``specdec serve``'s default): the
HTTP process and the engine never share an interpreter lock, so serializing and sending
responses cannot slow a step. Commands go down one pipe; the core's per-step messages come
up another in frames (``frames.py``) and are read on the event loop when the pipe is
readable, a frame that has only partly arrived kept for the next read (the loop never waits
on the pipe, whether the loop leaves it blocking or not). ``InprocCoreClient``
runs the same loop on a thread of this process (tests, embedding an engine object).

Commands travel in batches: a sender thread takes everything queued since its last send
and writes it as one list. The core reads the pipe on a thread that needs the core's
interpreter lock for every message, while its loop holds that lock to prepare steps (the
lock changes hands every few milliseconds), so a burst of arrivals sent a message each
waited one hand-off per message (``benchmarks/serve_core_intake.py`` measures it). The
event loop only queues; it never waits on the pipe.

Both: ``start(loop, on_message)`` begins delivering the core's messages to
``on_message`` on ``loop``; ``send(command)`` returns at once; ``shutdown()`` stops the
core after its current step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from specdec.serve.engine_core import (
    EngineCore,
    EngineInfo,
    build_llm_engine,
    engine_info,
    run_core_process,
)
from specdec.serve.frames import FrameReader

logger = logging.getLogger(__name__)

OnMessage = Callable[[tuple], None]


class EngineStartError(RuntimeError):
    """The engine core could not be built (its log says why)."""


class InprocCoreClient:
    """The core loop on a thread of this process, over an engine object built here."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.info: EngineInfo = engine_info(engine)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_message: OnMessage) -> None:
        def emit(message: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop closed during shutdown
                loop.call_soon_threadsafe(on_message, message)

        core = EngineCore(self.engine, self._inbox, emit)
        self._thread = threading.Thread(target=core.run, name="specdec-engine", daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._inbox.put(command)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._inbox.put(("shutdown",))
        if self._thread is not None:
            self._thread.join(timeout)


class ProcCoreClient:
    """The core loop in a child process that builds its own engine.

    ``build_engine(config)`` runs in the child (a picklable callable: ``build_llm_engine``
    by default, which imports the engine there, not here); for an ``EngineConfig`` the
    child resolves the model first and calls ``build_engine(config, resolved)``. The
    constructor returns once the engine is ready (``wait=False``: at once; call
    ``wait_ready`` before ``start``); it raises ``EngineStartError`` if the child fails or
    exits first.
    """

    info: EngineInfo

    def __init__(
        self,
        config: Any,
        build_engine: Callable[[Any], Any] | None = None,
        start_timeout: float | None = None,
        wait: bool = True,
    ) -> None:
        build_engine = build_engine or build_llm_engine
        # spawn, not fork: the child initialises CUDA, and this process may hold threads.
        ctx = multiprocessing.get_context("spawn")
        commands_out, commands_in = ctx.Pipe(duplex=False)  # (reader, writer)
        messages_out, messages_in = ctx.Pipe(duplex=False)
        self._commands = commands_in
        self._messages = messages_out  # read through self._frames, never .recv()
        self._frames = FrameReader(messages_out.fileno())
        self._early: list[tuple] = []  # messages read while waiting for "ready"
        self._started = time.monotonic()  # system-wide on Linux: the child reads it too
        self.process = ctx.Process(
            target=run_core_process,
            args=(build_engine, config, commands_out, messages_in, logging.getLogger().level,
                  self._started),
            name="specdec-engine-core",
            daemon=True,
        )  # fmt: skip
        self.process.start()
        # The child holds its ends; closing ours lets each side see the other's exit.
        commands_out.close()
        messages_in.close()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # commands; None: stop
        self._sender = threading.Thread(
            target=_send_commands,
            args=(self._outbox, self._commands),
            name="specdec-core-commands",
            daemon=True,
        )
        self._sender.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_resolved: Callable[[Any], None] | None = None
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(
        self, timeout: float | None = None, on_resolved: Callable[[Any], None] | None = None
    ) -> EngineInfo:
        """Block until the core has built its engine; sets and returns ``info``.
        ``on_resolved(model)`` is called as soon as the core has resolved its model (before
        its weights load; it must return at once), so the API side's own start-up can
        overlap the engine's."""
        self._on_resolved = on_resolved
        self.info = self._wait_ready(timeout)
        logger.info("engine core ready %.1f s after its start (pid %d)",
                    time.monotonic() - self._started, self.process.pid)  # fmt: skip
        return self.info

    def _wait_ready(self, timeout: float | None) -> EngineInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._messages.poll(1.0 if left is None else min(1.0, left)):
                try:
                    messages = self._frames.read()
                except EOFError:
                    messages = [("dead", f"the engine process exited ({self.process.exitcode})")]
                while messages:
                    message = messages.pop(0)
                    if message[0] == "ready":
                        self._early = messages
                        return message[1]
                    if message[0] == "resolved":
                        if self._on_resolved is not None:
                            self._on_resolved(message[1])
                        continue
                    self.process.join(10)
                    raise EngineStartError(f"the engine could not start: {message[1]}")
                continue
            if not self.process.is_alive():
                raise EngineStartError(
                    f"the engine process exited with code {self.process.exitcode} while "
                    "starting; its log above says why"
                )
            if deadline is not None and time.monotonic() >= deadline:
                self.process.kill()
                raise EngineStartError(f"the engine was not ready after {timeout} s")

    def start(self, loop: asyncio.AbstractEventLoop, on_message: OnMessage) -> None:
        self._loop = loop
        frames, fd = self._frames, self._frames.fd
        os.set_blocking(fd, False)  # read what is there, whatever the loop does to the pipe

        def readable() -> None:
            try:
                messages = frames.read()
            except (EOFError, OSError):
                loop.remove_reader(fd)
                code = self.process.exitcode
                on_message(("dead", f"the engine process exited (code {code})"))
                return
            for message in messages:
                on_message(message)

        for message in self._early:
            loop.call_soon(on_message, message)
        self._early = []
        loop.add_reader(fd, readable)

    def send(self, command: tuple) -> None:
        self._outbox.put(command)  # the sender thread batches it (module docstring)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._loop.remove_reader(self._messages.fileno())
        self.send(("shutdown",))
        self._outbox.put(None)
        self._sender.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        self._commands.close()
        self._messages.close()


def _send_commands(outbox: queue.SimpleQueue, commands) -> None:
    """The command sender (a thread of the API process): every command queued since the
    last send goes down the pipe as one list, in order, until ``None``. A core that is
    gone was (or will be) reported "dead" by the message reader; its commands are
    dropped."""
    while True:
        batch = [outbox.get()]
        while True:
            try:
                batch.append(outbox.get_nowait())
            except queue.Empty:
                break
        stop = None in batch
        if stop:
            batch = batch[: batch.index(None)]
        if batch:
            try:
                commands.send(batch)
            except (BrokenPipeError, OSError):
                return
        if stop:
            return
