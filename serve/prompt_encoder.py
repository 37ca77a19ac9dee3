"""Prompt texts → token ids off the API process's event loop, on a few workers, in batches.

A chat prompt of ~1,100 tokens takes ~3 ms to encode on one CPU core. Encoded on the
event loop, a burst of arrivals (64 chats at once when a benchmark wave starts or a group
of requests finishes together) holds the loop for tens of milliseconds: every stream's
chunks and every later arrival wait behind them, and each request's time to first token
grows with its place in the burst. ``PromptEncoder`` takes the encoding off the loop:

- ``encode(text)`` queues the text and awaits its ids. Up to ``workers`` worker tasks
  each take the oldest queued texts (at most ``max_batch``) and encode them in one batch
  call on a thread (``asyncio.to_thread``); texts that arrive while every worker is busy
  wait for the next free one. The first texts of a burst therefore start encoding at once
  and reach the engine first (first come, first encoded), instead of waiting for one batch
  of the whole burst. A fast (Rust) tokenizer releases the interpreter lock while it
  encodes, so the loop keeps streaming; a slow tokenizer still runs off the loop.
- The ids are those of ``tokenizer.encode(text, add_special_tokens=False)``: the same
  pipeline, text by text (the tests compare them). Chat prompts (rendered by their
  template) and completion prompts given as text both come through here.
- Each worker owns a copy of the tokenizer, used by one thread at a time (HF tokenizers
  must not be used from two threads at once; the event loop keeps the original for
  decoding).
- A text the tokenizer cannot encode fails only its own request: when a batch raises,
  its texts are encoded one at a time and each future gets its ids or its error.
"""

from __future__ import annotations

import asyncio
import copy
import os
from collections import deque
from typing import Any

MAX_WORKERS = 8


def default_shape(cpus: int | None = None) -> tuple[int, int]:
    """(workers, max_batch) for a machine of ``cpus`` cores (default: this one's): half
    the cores as workers (at most 8), each taking batches of ``max(4, 16 // workers)``.

    Measured with ``benchmarks/serve_prompt_encoding.py`` (64 WritingBench chats at once,
    docs/serving.md): on 16 cores 8 workers of 4 handed out ids after 35 ms on average
    against 42 for one call over the burst and 51 for one worker of 16 (a batch call
    spreads its texts over the cores, but a long text takes one core); on 2 cores one
    worker of 16 was best and more workers were slower (their calls share two cores).
    """
    cpus = cpus or os.cpu_count() or 1
    workers = min(MAX_WORKERS, max(1, cpus // 2))
    return workers, max(4, 16 // workers)


class PromptEncoder:
    """Off-loop ``encode`` for one event loop, ``workers`` batches at a time (module
    docstring)."""

    def __init__(
        self, tokenizer: Any, workers: int | None = None, max_batch: int | None = None
    ) -> None:
        """``workers`` / ``max_batch`` None: ``default_shape()``'s."""
        auto_workers, auto_batch = default_shape()
        workers = auto_workers if workers is None else workers
        max_batch = auto_batch if max_batch is None else max_batch
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.workers, self.max_batch = workers, max_batch
        # Idle tokenizer copies; a running worker holds one.
        self._idle = [copy.deepcopy(tokenizer) for _ in range(workers)]
        self._queue: deque[tuple[str, asyncio.Future[list[int]]]] = deque()
        self._running: set[asyncio.Task] = set()
        self.num_batches = 0  # batch calls made so far

    async def encode(self, text: str) -> list[int]:
        """``text``'s token ids, no special tokens added (a chat template writes its own)."""
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.append((text, future))
        if self._idle:
            task = asyncio.create_task(self._work(self._idle.pop()))
            self._running.add(task)  # a strong reference until it ends
            task.add_done_callback(self._running.discard)
        return await future

    async def _work(self, tokenizer: Any) -> None:
        """One worker: batches off the queue's head until it is empty."""
        try:
            while self._queue:
                batch = []
                while self._queue and len(batch) < self.max_batch:
                    text, future = self._queue.popleft()
                    if not future.done():  # done: cancelled, its client left
                        batch.append((text, future))
                if not batch:
                    continue
                texts = [t for t, _ in batch]
                results = await asyncio.to_thread(encode_texts, tokenizer, texts)
                self.num_batches += 1
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._idle.append(tokenizer)


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int] | BaseException]:
    """``texts``' ids in one batch call, or text by text if the batch raised (each text's
    ids or its error); what a worker runs on its thread."""
    # A fast tokenizer's Rust backend directly: the batch wrapper's Python conversions
    # would hold the interpreter lock for milliseconds per batch. ``encode_batch_fast``
    # (tokenizers >= 0.20) skips the character offsets the ids do not need: the same ids
    # in ~35% less time a text (SmolLM2's tokenizer, WritingBench chats, 2-core CPU).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if backend is not None:
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    except Exception:
        results: list[list[int] | BaseException] = []
        for text in texts:
            try:
                results.append(list(tokenizer.encode(text, add_special_tokens=False)))
            except Exception as e:
                results.append(e)
        return results
