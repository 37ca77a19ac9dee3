"""Prompt texts → token ids off the API process's event loop, in batches.

A chat prompt of ~1,100 tokens takes ~3 ms to encode on one CPU core. Encoded on the
event loop, a burst of arrivals (16 chats at once when a benchmark wave starts or a group
of requests finishes together) holds the loop for tens of milliseconds: every stream's
chunks and every later arrival wait behind them, and each request's time to first token
grows with its place in the burst. ``PromptEncoder`` takes the encoding off the loop:

- ``encode(text)`` queues the text and awaits its ids. One worker task encodes everything
  queued so far in one batch call on a thread (``asyncio.to_thread``); texts that arrive
  while a batch is encoding form the next batch. A fast (Rust) tokenizer encodes a batch
  on several cores and releases the interpreter lock meanwhile, so the loop keeps
  streaming; a slow tokenizer encodes the batch in turn, still off the loop.
- The ids are those of ``tokenizer.encode(text, add_special_tokens=False)``: the same
  pipeline, text by text (the tests compare them).
- The encoder owns a copy of the tokenizer, used by one thread at a time (HF tokenizers
  must not be used from two threads at once; the event loop keeps the original for
  decoding).
- A text the tokenizer cannot encode fails only its own request: when a batch raises,
  its texts are encoded one at a time and each future gets its ids or its error.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any


class PromptEncoder:
    """Batched, off-loop ``encode`` for one event loop (module docstring)."""

    def __init__(self, tokenizer: Any, max_batch: int = 256) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self._tokenizer = copy.deepcopy(tokenizer)
        self.max_batch = max_batch
        self._queue: list[tuple[str, asyncio.Future[list[int]]]] = []
        self._worker: asyncio.Task | None = None
        self.num_batches = 0  # batch calls made so far

    async def encode(self, text: str) -> list[int]:
        """``text``'s token ids, no special tokens added (a chat template writes its own)."""
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.append((text, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            live = [(t, f) for t, f in batch if not f.done()]  # cancelled: its client left
            if not live:
                continue
            results = await asyncio.to_thread(self._encode_all, [t for t, _ in live])
            self.num_batches += 1
            for (_, future), result in zip(live, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _encode_all(self, texts: list[str]) -> list[list[int] | BaseException]:
        """On the worker thread: one batch call, or text by text if the batch raised."""
        tokenizer = self._tokenizer
        # A fast tokenizer's Rust backend directly: the batch wrapper's Python conversions
        # would hold the interpreter lock for milliseconds per batch.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            if backend is not None:
                return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
            return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        except Exception:
            results: list[list[int] | BaseException] = []
            for text in texts:
                try:
                    results.append(list(tokenizer.encode(text, add_special_tokens=False)))
                except Exception as e:
                    results.append(e)
            return results
