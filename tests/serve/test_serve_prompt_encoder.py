"""``PromptEncoder``: prompt texts encoded off the event loop, on a few workers, in
batches taken first come first served, to exactly the ids the server's /tokenize and the
offline ``LLM.chat`` give."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest

from specdec.serve.inputs import chat_prompt_ids, chat_prompt_text
from specdec.serve.prompt_encoder import PromptEncoder
from specdec.serve.protocol import ChatCompletionRequest

CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about paged attention."}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Name three rivers."},
    ],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3? Show <|im_end|> literally."},
    ],
    [{"role": "user", "content": "Ünïcödé, emoji 🚀, tabs\tand\nnewlines  "}],
    [{"role": "user", "content": ""}],
]


def _template_ids(tokenizer, conversation, add_generation_prompt: bool) -> list[int]:
    """What the offline ``LLM.chat`` uses: the template's own tokenization."""
    ids = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def _body(conversation, add_generation_prompt: bool = True) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=conversation, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("add_bos", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encoded_chats_equal_the_templates_tokenization(
    smollm2_tokenizer, add_generation_prompt: bool, add_bos: bool
):
    """Batched (the encoder), one at a time (/tokenize's ``chat_prompt_ids``) and the
    template's own tokenization agree, also for a tokenizer that adds a BOS on encode:
    the template writes its special tokens, so no path may add one."""
    tokenizer = smollm2_tokenizer
    if add_bos:
        tokenizer = copy.deepcopy(smollm2_tokenizer)
        tokenizer.add_bos_token = True
        assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id  # the setting took
    bodies = [_body(c, add_generation_prompt) for c in CONVERSATIONS]
    want = [_template_ids(tokenizer, c, add_generation_prompt) for c in CONVERSATIONS]
    assert [chat_prompt_ids(tokenizer, b) for b in bodies] == want

    async def encode_all() -> list[list[int]]:
        encoder = PromptEncoder(tokenizer)
        texts = [chat_prompt_text(tokenizer, b) for b in bodies]
        return await asyncio.gather(*(encoder.encode(t) for t in texts))

    assert asyncio.run(encode_all()) == want


@pytest.mark.parametrize(
    ("workers", "max_batch", "fewest", "most"), [(1, 256, 1, 2), (4, 8, 8, 11)]
)
def test_a_burst_is_encoded_in_few_batches_and_each_request_gets_its_own_ids(
    smollm2_tokenizer, workers: int, max_batch: int, fewest: int, most: int
):
    """64 concurrent prompts of WritingBench-length text: every future gets its own
    text's ids, and texts queued while the workers are busy go in their next batches, not
    one call each."""
    texts = [f"request {i}: " + "a paged attention kernel " * (20 + i) for i in range(64)]
    want = [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]

    async def burst():
        encoder = PromptEncoder(smollm2_tokenizer, workers=workers, max_batch=max_batch)
        got = await asyncio.gather(*(encoder.encode(t) for t in texts))
        return got, encoder.num_batches

    got, batches = asyncio.run(burst())
    assert got == want
    assert fewest <= batches <= most, batches


def test_workers_take_the_oldest_texts_in_batches_of_at_most_max_batch():
    """First come, first encoded: each batch call holds the oldest texts queued when it
    started, in arrival order; no more than ``workers`` calls run at once; texts arriving
    while every worker is busy wait for the next free one, and a worker started by a lone
    arrival encodes it at once."""
    calls: list[list[str]] = []
    lock = threading.Lock()
    active = peak = 0

    class Tokenizer:
        def __call__(self, texts, add_special_tokens):
            nonlocal active, peak
            with lock:
                calls.append(list(texts))
                active += 1
                peak = max(peak, active)
            time.sleep(0.02)  # long enough for every arrival to queue meanwhile
            with lock:
                active -= 1
            return {"input_ids": [[int(t)] for t in texts]}

    async def run():
        encoder = PromptEncoder(Tokenizer(), workers=3, max_batch=4)
        tasks = []
        for i in range(3):  # lone arrivals, apart: each starts a worker at once
            tasks.append(asyncio.create_task(encoder.encode(str(i))))
            await asyncio.sleep(0.005)
        tasks += [asyncio.create_task(encoder.encode(str(i))) for i in range(3, 20)]
        return await asyncio.gather(*tasks)

    ids = asyncio.run(run())
    assert ids == [[i] for i in range(20)]
    assert all(len(c) <= 4 for c in calls) and peak <= 3
    assert calls[:3] == [["0"], ["1"], ["2"]]
    # The texts queued meanwhile: consecutive runs from the queue's head, in order.
    later = sorted(calls[3:], key=lambda c: int(c[0]))
    assert [int(t) for c in later for t in c] == list(range(3, 20))


def test_a_text_that_cannot_be_encoded_fails_only_its_own_request():
    """The batch call raises; each text is then encoded alone and only the bad one's
    future carries the error."""

    class Tokenizer:
        calls = 0

        def __call__(self, texts, add_special_tokens):
            Tokenizer.calls += 1
            if any("\udcff" in t for t in texts):
                raise ValueError("lone surrogate")
            return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}

        def encode(self, text, add_special_tokens):
            if "\udcff" in text:
                raise ValueError(f"cannot encode {text!r}")
            return [ord(c) for c in text]

    async def run():
        encoder = PromptEncoder(Tokenizer())
        return await asyncio.gather(
            encoder.encode("ok"),
            encoder.encode("bad \udcff"),
            encoder.encode("fine"),
            return_exceptions=True,
        )

    ok, bad, fine = asyncio.run(run())
    assert ok == [ord("o"), ord("k")] and fine == [ord(c) for c in "fine"]
    assert isinstance(bad, ValueError) and "cannot encode" in str(bad)


def test_encoding_runs_off_the_event_loops_thread():
    """The tokenizer is called on a worker thread, never the loop's own (which keeps
    streaming meanwhile), and on the encoder's copy, not the loop's tokenizer."""

    threads: set[int] = set()

    class Tokenizer:
        def __call__(self, texts, add_special_tokens):
            threads.add(threading.get_ident())
            return {"input_ids": [[len(t)] for t in texts]}

    original = Tokenizer()

    async def run():
        encoder = PromptEncoder(original)
        assert all(t is not original for t in encoder._idle)
        ids = await asyncio.gather(*(encoder.encode("x" * i) for i in range(5)))
        return ids, threading.get_ident()

    ids, loop_thread = asyncio.run(run())
    assert ids == [[i] for i in range(5)]
    assert threads and loop_thread not in threads


def test_workers_and_max_batch_are_validated():
    with pytest.raises(ValueError, match="max_batch=0 must be >= 1"):
        PromptEncoder(None, max_batch=0)
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        PromptEncoder(None, workers=0)


@pytest.mark.parametrize(
    ("cpus", "shape"), [(1, (1, 16)), (2, (1, 16)), (4, (2, 8)), (16, (8, 4)), (128, (8, 4))]
)
def test_the_default_shape_follows_the_cores(cpus: int, shape: tuple[int, int]):
    """Half the cores as workers, at most 8; batches of max(4, 16 // workers); an encoder
    or server left unset takes this machine's."""
    from specdec.serve.prompt_encoder import default_shape

    assert default_shape(cpus) == shape
    encoder = PromptEncoder(None)
    assert (encoder.workers, encoder.max_batch) == default_shape()
