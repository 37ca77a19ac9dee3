"""A real ``specdec serve`` process on 127.0.0.1 for the serve tests, and /metrics parsing."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

# fp32 on CPU with a small pool and context: fast to start, big enough for the tests.
CPU_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(256 << 20)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until /health answers 200; raises with the server log if it dies or hangs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def unhandled_errors(self) -> list[str]:
        """Server log lines of errors that reached the catch-all (each one a 500 or a
        crashed response); a correct server has none, whatever its clients sent."""
        lines = self.log.read_text(errors="replace").splitlines()
        return [line for line in lines if line.startswith("ERROR") or "Traceback" in line]


def start_server(args: list[str]) -> ServerProcess:
    """``python -m specdec.serve ARGS`` on a free port (returns at once; ``wait_ready``)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="specdec-serve-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return ServerProcess(proc, port, log)


@contextlib.contextmanager
def running_server(args: list[str]) -> Iterator[ServerProcess]:
    """``start_server(args)``, ready; stopped after the block, whose end also checks that
    no request reached the server's catch-all error handler."""
    server = start_server(args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert not server.unhandled_errors(), server.log_tail()


def scrape(url: str) -> dict[str, float]:
    """/metrics as {series (name plus labels): value}, without comments."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values
