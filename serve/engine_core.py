"""The engine core: one ``LLMEngine`` driven by a loop that never waits on the HTTP side.

``EngineCore.run`` applies queued commands (add, abort, shutdown), runs one engine step and
emits one message per step with every request's new tokens: the API side detokenizes,
frames SSE and serializes JSON, so none of that sits on the engine's critical path. The
loop runs in its own process (``run_core_process``, what ``specdec serve`` uses: the HTTP
process's Python never holds the engine's interpreter lock) or on a thread of the caller's
process (``core_client.InprocCoreClient``: tests and embedding). Both speak the messages
below; only the transport differs.

Commands (API side → core), tuples (``core_client.ProcCoreClient`` writes them to the
pipe in lists: everything queued since its last send):
    ("add", request_id, prompt_token_ids, SamplingParams, sent_at)
                                               sent_at: the API side's time.monotonic()
                                               as it sent the request (system-wide, so
                                               comparable here): the request's arrival
                                               time in the engine, whose queue time then
                                               counts the channel and the step it waited
                                               out before the loop read it
    ("abort", request_id)
    ("shutdown",)
Messages (core → API side), tuples:
    ("resolved", ResolvedModel)                once, before the weights load (the API
                                               side loads its tokenizer meanwhile)
    ("ready", EngineInfo)                      once, after the engine is built
    ("added", [(request_id, error | None)])   the verdicts on the adds applied together,
                                               before their first step
    ("step", [TokenDelta], EngineSnapshot | None)
    ("dead", "Type: message")                 the loop failed; nothing more comes

The core's requests report ``TokenDelta`` tuples (``RequestOutputKind.TOKENS``: new token
ids and logprobs, the finish reason, metrics on the finishing one), cheap to build every
step and to pickle; the engine builds no text and no ``RequestOutput`` for them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from specdec.outputs import TokenDelta
from specdec.sampling_params import RequestOutputKind, SamplingParams
from specdec.serve.frames import write_frame
from specdec.spec.spec_exit_runtime import SpecExitRuntime

logger = logging.getLogger(__name__)

# An engine state snapshot rides on a step message at most this often (and whenever the
# engine goes idle, so counters read after a load are final).
SNAPSHOT_INTERVAL_S = 0.05


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state after a core iteration (what /metrics reports). Counters are
    cumulative since start; blocks exclude the null block."""

    num_running: int = 0
    num_waiting: int = 0
    kv_total_blocks: int = 0
    kv_free_blocks: int = 0
    prefix_cache_queries: int = 0  # blocks looked up in the prefix cache
    prefix_cache_hits: int = 0  # blocks found there
    num_steps: int = 0
    num_graph_steps: int = 0  # target forwards replayed from a CUDA graph (the rest ran eagerly)
    num_preemptions: int = 0
    spec_depth: int = 0  # draft positions (0 without speculation)
    spec_steps: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_at_least: tuple[int, ...] = ()  # [k-1]: steps accepting >= k tokens
    spec_exit_requests: int = 0  # requests that opted into SpecExit
    spec_exit_exits: int = 0  # thinking cut short
    spec_exit_tokens_saved: float = 0.0  # the head's remaining-tokens estimate at exits
    # Deferred speculation graphs are still being captured: steps decode plainly until then.
    spec_graphs_pending: bool = False
    # Any deferred graph remains (speculation's or wider steps'): captures still stall steps.
    graphs_pending: bool = False

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks held by requests (0.0 .. 1.0)."""
        if not self.kv_total_blocks:
            return 0.0
        return 1.0 - self.kv_free_blocks / self.kv_total_blocks


@dataclass(frozen=True)
class EngineInfo:
    """What the API side needs to know of the engine it serves (sent once, at start)."""

    model: Any  # ResolvedModel, or a model name: ``load_tokenizer`` takes either
    max_model_len: int
    num_kv_blocks: int
    device: str
    dtype: str
    speculation: str  # one line for the log, e.g. "eagle3 speculation, chain of depth 3"
    has_spec_exit: bool  # the head has SpecExit channels
    spec_exit_head_defaults: Any  # the head's recorded SpecExit settings (or None)


def engine_info(engine) -> EngineInfo:
    runtime = engine.runner.runtime
    spec = engine.config.speculative
    runtime_exit = engine.hook(SpecExitRuntime)
    return EngineInfo(
        model=engine.resolved,
        max_model_len=engine.max_model_len,
        num_kv_blocks=engine.kv_manager.pool.num_usable_blocks,
        device=str(runtime.device),
        dtype=str(runtime.dtype).removeprefix("torch."),
        speculation=(
            f"{spec.method} speculation, {spec.tree} of depth {spec.num_speculative_tokens}"
            if spec is not None
            else "no speculation"
        ),
        has_spec_exit=runtime_exit is not None,
        spec_exit_head_defaults=runtime_exit.head_defaults if runtime_exit else None,
    )


def take_snapshot(engine) -> EngineSnapshot:
    pool = engine.kv_manager.pool
    spec = engine.spec_stats
    runtime_exit = engine.hook(SpecExitRuntime)
    exits = runtime_exit.stats if runtime_exit is not None else None
    return EngineSnapshot(
        num_running=engine.scheduler.num_running,
        num_waiting=engine.scheduler.num_waiting,
        kv_total_blocks=pool.num_usable_blocks,
        kv_free_blocks=pool.num_free_blocks,
        prefix_cache_queries=pool.prefix_queries,
        prefix_cache_hits=pool.prefix_hits,
        num_steps=engine.num_steps,
        num_graph_steps=engine.num_graph_steps,
        num_preemptions=engine.scheduler.num_preemptions,
        spec_depth=engine.proposer.max_depth if engine.proposer is not None else 0,
        spec_steps=spec.steps,
        spec_drafted_tokens=spec.drafted_tokens,
        spec_accepted_tokens=spec.accepted_tokens,
        spec_accepted_at_least=tuple(spec.accepted_at_least),
        spec_exit_requests=exits.requests if exits else 0,
        spec_exit_exits=exits.exits if exits else 0,
        spec_exit_tokens_saved=exits.tokens_saved if exits else 0.0,
        spec_graphs_pending=engine.speculation_graphs_pending,
        graphs_pending=engine.has_pending_graphs,
    )


def core_params(params: SamplingParams) -> SamplingParams:
    """What the core runs for an API request: token ids out per step, no text (the API
    side detokenizes and matches stop strings, then aborts the request)."""
    return replace(params, stop=[], output_kind=RequestOutputKind.TOKENS)


class EngineCore:
    """Runs ``engine`` until a shutdown command; ``emit`` takes each message (it must not
    block: a transport queues or posts it). Only this loop's thread touches the engine."""

    def __init__(self, engine, inbox: queue.SimpleQueue, emit: Callable[[tuple], None]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.emit = emit
        self._last_snapshot = 0.0
        self._changed = True  # since the last snapshot sent
        self._verdicts: list[tuple[str, str | None]] = []  # adds applied, not yet reported

    def run(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
        except BaseException as e:
            logger.exception("the engine loop failed; the server cannot generate any more")
            self.emit(("dead", f"{type(e).__name__}: {e}"))

    def _iteration(self) -> bool:
        """Apply queued commands (waiting for one while idle), then run one step if any
        request is unfinished. Idle with deferred graphs left to capture, it
        captures one instead of waiting (``LLMEngine.capture_pending_graph``). Returns
        False once shutdown was asked for."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            if self._changed:  # idle from here: what /metrics reads now is final
                self._send_snapshot([])
            if engine.has_pending_graphs:
                try:
                    command = self.inbox.get_nowait()
                except queue.Empty:
                    engine.capture_pending_graph()
                    self._changed = True  # a snapshot next: after the last one, /metrics says so
                    return True
            else:
                command = self.inbox.get()
            if not self._apply(command):
                return False
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            if not self._apply(command):
                return False
        if self._verdicts:  # one message for a burst's adds: the writer pickles it once
            self.emit(("added", self._verdicts))
            self._verdicts = []
        if not engine.has_unfinished_requests():
            return True
        outputs = engine.step()
        self._changed = True
        if time.monotonic() - self._last_snapshot >= SNAPSHOT_INTERVAL_S:
            self._send_snapshot(outputs)
        elif outputs:
            self.emit(("step", outputs, None))
        return True

    def _send_snapshot(self, outputs: list[TokenDelta]) -> None:
        self.emit(("step", outputs, take_snapshot(self.engine)))
        self._last_snapshot = time.monotonic()
        self._changed = False

    def _apply(self, command: tuple) -> bool:
        kind = command[0]
        self._changed = True
        if kind == "add":
            _, request_id, prompt, params, sent_at = command
            error = None
            try:
                self.engine.add_request(prompt, core_params(params), request_id, sent_at)
            except (ValueError, TypeError) as e:  # bad input: the engine state is unchanged
                error = str(e)
            self._verdicts.append((request_id, error))
        elif kind == "abort":
            self.engine.abort_request(command[1])
        elif kind == "shutdown":
            return False
        else:
            raise ValueError(f"unknown engine core command {kind!r}")
        return True


# ---- the core's own process --------------------------------------------------------------
def build_llm_engine(config: Any, resolved: Any = None):
    """The core process's default engine: ``LLMEngine(config, resolved)``. The engine
    (torch, the model code) is imported here, in the core process only: the API process
    spawns the core without importing torch first."""
    from specdec.engine.llm_engine import LLMEngine

    return LLMEngine(config, resolved)


def run_core_process(build_engine: Callable[..., Any], config: Any, commands, messages,
                     log_level: int, launched: float | None = None) -> None:  # fmt: skip
    """Entry point of the engine core process (``multiprocessing`` spawn target).

    ``commands`` / ``messages`` are one-way ``multiprocessing`` connections (messages go up
    as frames, ``frames.py``; commands as the connection's own messages). A reader thread
    turns commands into the loop's inbox and a writer thread sends its messages, so the
    loop neither blocks on a slow reader nor waits for input. The process ends on a
    shutdown command, or when the API process goes away (its end of ``commands`` closes).
    ``launched``: the parent's ``time.monotonic()`` when it started this process, for the
    start-up log.
    """
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    if launched is not None:
        logger.info(
            "engine core process up %.1f s after its spawn; importing the engine and building it",
            time.monotonic() - launched,
        )
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    writer = threading.Thread(target=_write, args=(outbox, messages), daemon=True)
    writer.start()
    try:
        start = time.perf_counter()
        if hasattr(config, "model") and hasattr(config, "cache_dir"):  # an EngineConfig
            from specdec.models import resolve_model

            resolved = resolve_model(config.model, cache_dir=config.cache_dir)
            logger.info("imported the model code (torch) and resolved %s to %s in %.1f s",
                        config.model, resolved.hf_dir, time.perf_counter() - start)  # fmt: skip
            outbox.put(("resolved", resolved))
            start = time.perf_counter()
            engine = build_engine(config, resolved)
        else:
            engine = build_engine(config)
    except BaseException as e:
        logger.exception("the engine could not be built")
        outbox.put(("dead", f"{type(e).__name__}: {e}"))
        outbox.put(None)
        writer.join(10)
        return
    logger.info("built the engine in %.1f s", time.perf_counter() - start)
    outbox.put(("ready", engine_info(engine)))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    reader = threading.Thread(target=_read, args=(commands, inbox), daemon=True)
    reader.start()
    EngineCore(engine, inbox, outbox.put).run()
    outbox.put(None)
    writer.join(10)
    # Daemon threads and CUDA teardown can hang an interpreter's exit; the engine is done.
    os._exit(0)


def _read(commands, inbox: queue.SimpleQueue) -> None:
    """The command reader (a thread): each message is a list of commands, in order
    (``core_client._send_commands``)."""
    try:
        while True:
            for command in commands.recv():
                inbox.put(command)
    except (EOFError, OSError):  # the API process is gone: stop serving
        inbox.put(("shutdown",))


def _write(outbox: queue.SimpleQueue, messages) -> None:
    """The message writer (a thread): each message one frame (``frames.py``: the API side
    reads them from its event loop without waiting for a frame's rest)."""
    fd = messages.fileno()
    while (message := outbox.get()) is not None:
        try:
            write_frame(fd, message)
        except (BrokenPipeError, OSError):  # the API process is gone
            return
