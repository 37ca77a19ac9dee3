"""Finished conversations → records (token ids + assistant loss mask), off the engine loop.

Building a record renders the whole conversation and its prefixes through the chat
template and tokenises the pieces (``chat.tokenize_conversation``): ~1.5-2 ms of host time
per conversation, 30% of regeneration's wall time on the H200 when done inline, while the
GPU waits for the next step. ``RecordPool`` runs that work in worker processes (spawned,
each with its own copy of the tokenizer), so the engine loop only pays for pickling the
messages. Records are the same whichever process builds them.

``workers=0`` builds inline (tests, small machines): ``build`` then returns a finished
future, so callers have one code path.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

from specdec.data_gen.chat import tokenize_conversation
from specdec.data_gen.records import BadRecord

# (input_ids, loss_mask), or the skip reason of a record that cannot be used.
Built = tuple[list[int], list[int]] | str

_worker_tokenizer = None  # set in each worker process by _init_worker


def default_workers() -> int:
    """A quarter of the host's cores, at most 4; none below 8 cores, where the workers
    would compete with the engine loop for the CPU."""
    cores = os.cpu_count() or 1
    return 0 if cores < 8 else min(4, cores // 4)


def build_record(
    tokenizer, messages: list[dict[str, str]], emitted: list[list[int]] | None = None
) -> Built:
    """``emitted``: the generated token ids of each assistant message
    (``chat.tokenize_conversation``)."""
    try:
        tok = tokenize_conversation(tokenizer, messages, emitted)
    except BadRecord as e:
        return e.reason
    return tok.input_ids, tok.loss_mask


def _init_worker(tokenizer_dir: str, chat_template: str | None) -> None:
    global _worker_tokenizer
    from transformers import AutoTokenizer

    _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if chat_template is not None:
        _worker_tokenizer.chat_template = chat_template


def _build_in_worker(messages: list[dict[str, str]], emitted: list[list[int]] | None) -> Built:
    return build_record(_worker_tokenizer, messages, emitted)


class RecordPool:
    """``build(messages, emitted)`` → a future of ``Built``. ``tokenizer`` builds inline; the
    workers load the tokenizer saved in ``tokenizer_dir`` and apply ``chat_template``
    (the override the caller applied to ``tokenizer``, if any)."""

    def __init__(
        self, tokenizer, tokenizer_dir: str, chat_template: str | None, workers: int
    ) -> None:
        if workers < 0:
            raise ValueError(f"record workers={workers} must be >= 0 (0: build inline)")
        self.tokenizer = tokenizer
        self._executor = None
        if workers:
            self._executor = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),  # no fork of CUDA state
                initializer=_init_worker,
                initargs=(str(tokenizer_dir), chat_template),
            )

    def build(
        self, messages: list[dict[str, str]], emitted: list[list[int]] | None = None
    ) -> Future:
        if self._executor is not None:
            return self._executor.submit(_build_in_worker, messages, emitted)
        future: Future = Future()
        future.set_result(build_record(self.tokenizer, messages, emitted))
        return future

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
