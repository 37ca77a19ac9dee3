"""``specdec serve``'s start-up order: the engine core first, then the API side's imports.

``launch`` spawns the engine core process before this process imports FastAPI or torch,
and starts a thread that imports the tokenizer stack (transformers, which imports torch)
and then loads the model's tokenizer once the core has resolved the model. So the core's
imports, weight load and graph capture overlap the API side's imports and tokenizer load
instead of following them. This module imports neither FastAPI nor torch; with the
engine on a thread of this process (``--no-engine-process``) ``launch`` imports the
engine's modules itself, before the tokenizer thread starts.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.serve.config import ServeConfig
    from specdec.serve.core_client import ProcCoreClient

logger = logging.getLogger(__name__)

# What the API side imports from the serve extra (FastAPI pulls in starlette and pydantic).
SERVE_EXTRA_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def process_age() -> float:
    """Seconds since this process was started (Linux's /proc; 0.0 where unavailable), so
    start-up logs count the interpreter and the imports before any of our code ran."""
    try:
        # Field 22, starttime, in clock ticks since boot; the name in field 2 may hold spaces.
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max(0.0, boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def missing_serve_module() -> str | None:
    """The first module of the serve extra that is not installed (found without importing
    it), or None."""
    return next((m for m in SERVE_EXTRA_MODULES if importlib.util.find_spec(m) is None), None)


class TokenizerLoader:
    """The API side's tokenizer, loaded on a daemon thread that starts at construction:
    it imports the tokenizer stack at once, then waits for ``resolve(model)`` (a
    ``ResolvedModel`` or a model name) and loads that model's tokenizer."""

    def __init__(self) -> None:
        self._model: Future = Future()
        self._tokenizer: Future = Future()
        threading.Thread(target=self._load, name="specdec-tokenizer", daemon=True).start()

    def resolve(self, model: Any) -> None:
        """Name the model whose tokenizer to load; calls after the first are ignored."""
        if not self._model.done():
            self._model.set_result(model)

    def result(self, timeout: float | None = None):
        """The tokenizer (blocks until loaded; raises what loading raised)."""
        return self._tokenizer.result(timeout)

    def _load(self) -> None:
        try:
            start = time.perf_counter()
            from transformers import AutoTokenizer  # noqa: F401 (what load_tokenizer uses)

            from specdec.models import load_tokenizer

            imported = time.perf_counter()
            model = self._model.result()
            waited = time.perf_counter()
            tokenizer = load_tokenizer(model)
            logger.info(
                "loaded the tokenizer in %.1f s (after its imports, %.1f s, overlapping the "
                "engine core's start-up)",
                time.perf_counter() - waited,
                imported - start,
            )
            self._tokenizer.set_result(tokenizer)
        except BaseException as e:
            self._tokenizer.set_exception(e)


@dataclass
class Launch:
    """A server start in progress (``launch``)."""

    core: ProcCoreClient | None  # not ready yet; None: the engine runs on a thread here
    tokenizer: TokenizerLoader
    started: float  # time.monotonic() when this process started

    def seconds(self) -> float:
        """Seconds since this process started."""
        return time.monotonic() - self.started

    def abort(self) -> None:
        """Stop the core process (the server will not start)."""
        if self.core is not None:
            self.core.process.kill()
            self.core.process.join(5)


def launch(config: ServeConfig) -> Launch:
    """Start ``config``'s engine core process, unless it runs on a thread of this process,
    and the tokenizer thread; returns at once."""
    from specdec.serve.core_client import ProcCoreClient

    started = time.monotonic() - process_age()
    logger.info(
        "starting the engine core for %s (%s) %.1f s after launch",
        config.engine.model,
        "its own process" if config.engine_process else "a thread of this process",
        time.monotonic() - started,
    )
    core = ProcCoreClient(config.core_engine, wait=False) if config.engine_process else None
    if core is None:
        # The engine will be built here, so its modules are imported before the tokenizer
        # thread starts: two threads importing one package's __init__ and its submodules
        # (specdec.attention, specdec.models) in different orders can each wait on the
        # other's module lock, and Python raises _DeadlockError in one of them.
        import specdec.engine.llm_engine  # noqa: F401
    # After the spawn: the tokenizer thread's imports would hold the interpreter lock.
    return Launch(core, TokenizerLoader(), started)
