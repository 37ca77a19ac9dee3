"""vLLM's CPU build in its own virtual environment, and its OpenAI server on 127.0.0.1.

The venv comes from ``scripts/vllm_venv.sh`` (idempotent: a ready venv costs a second;
building one takes minutes, so the tests build it on first use rather than every run).
vLLM pins its own torch, which must never reach specdec's environment: the server runs
with the venv's python as ``python -m vllm.entrypoints.openai.api_server`` (this build's
``vllm`` console script fails), in its own process group so that its engine and worker
children stop with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from serve_server import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
SKIP_ENV = "SPECDEC_SKIP_VLLM"  # set to 1 on machines that cannot build the venv
# vLLM CPU: 2 GiB of KV cache, no hub access, specdec's test-time settings kept out.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
_DROPPED_ENV = ("TRITON_INTERPRET", "PYTHONPATH", "VIRTUAL_ENV")


def vllm_python() -> Path:
    """The venv's python, building the venv if needed (raises with the build log)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/vllm_venv.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/vllm_venv.sh failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def exclusive_vllm() -> Iterator[Path]:
    """``vllm_python()``, held by one test process of this machine at a time until the
    block ends: pytest-xdist workers (scripts/test.sh) would otherwise build the venv
    twice at once, or run two vLLM servers on the same cores. Never nest it in one
    process (the second lock would wait on the first)."""
    with (Path(tempfile.gettempdir()) / "specdec-vllm-tests.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield vllm_python()


@dataclass
class VllmServer(ServerProcess):
    def stop(self) -> None:
        """SIGTERM the server's process group (API server, engine core, worker), then
        SIGKILL whatever is left of it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_vllm(python: Path, model: Path, args: list[str]) -> VllmServer:
    """The OpenAI server for ``model`` on a free port, fp32 and eager (no torch.compile:
    it costs minutes on CPU); returns at once (``wait_ready``)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV} | VLLM_ENV
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "1024", "--seed", "0", *args,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return VllmServer(proc, port, log)
