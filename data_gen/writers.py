"""Background shard writing for the dump: host buffers the device copies into, and the
threads that serialise, hash and write shards from them while the next forward runs."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch


@dataclass
class HostBuffers:
    aux: torch.Tensor  # [max_tokens, 3 * hidden] storage dtype (pinned on the GPU path)
    hidden: torch.Tensor  # [max_tokens, hidden]


class ShardWriters:
    """Background threads that run a group's shard writes. The caller takes buffers with
    ``free.get()``, which blocks while every buffer is still being written (backpressure),
    and hands them back through ``submit``: they return to ``free`` once the group's last
    shard is written. ``check`` re-raises a writer's error in the caller's thread."""

    def __init__(self, num_threads: int, buffers: list[HostBuffers]) -> None:
        self.free: queue.Queue[HostBuffers] = queue.Queue()
        for b in buffers:
            self.free.put(b)
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.written = 0  # shards written successfully
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._work, daemon=True) for _ in range(num_threads)
        ]
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            write, done = job
            try:
                if self.error is None:
                    write()
                    with self._lock:
                        self.written += 1
            except BaseException as e:  # surfaced in the main thread by check()
                self.error = e
            finally:
                done()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"writing a shard failed: {self.error}") from self.error

    def submit(self, writes: list, buffers: HostBuffers, event) -> None:
        remaining = [len(writes)]

        def done() -> None:
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    self.free.put(buffers)

        def wrap(fn):
            def run():
                if event is not None:
                    event.synchronize()  # the device-to-host copies have landed
                fn()

            return run

        for fn in writes:
            self.jobs.put((wrap(fn), done))

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()
        self.check()
