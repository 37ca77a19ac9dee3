"""Incremental detokenization with stop strings: token ids in, stream-safe text deltas out.

Two things make naive per-token decoding wrong. A character can span tokens (byte-level
BPE splits UTF-8), so text decoded so far may end in U+FFFD that a later token completes;
and a tokenizer's decode can depend on neighbouring tokens (leading-space handling). So
each new token is decoded inside a short window: ``prefix`` tokens whose text is already
out, plus the ``unread`` tokens after them; the new text is ``decode(prefix + unread)``
minus ``decode(prefix)``, released only once it no longer ends in U+FFFD. Each release
makes the unread tokens the next prefix, so every call costs O(new tokens).

Stop strings: the output text ends where the earliest stop string occurrence starts (or,
with ``include_stop_str_in_output``, where it ends). Deltas never run past that point:
text that could be the beginning of a stop string is held back until it is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdec.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the first output token so it sees its real left context.
_PROMPT_CONTEXT_TOKENS = 4
# A run of tokens that still decodes to an unfinished character (or to nothing, e.g. skipped
# special tokens) is released after this many, so garbage output cannot grow the window.
# A UTF-8 character is at most 4 bytes, so well-formed text never gets near it.
_MAX_UNREAD_TOKENS = 16


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the detokenizer needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs) -> str: ...


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one ``append`` produced.

    ``text_delta`` is safe to stream: it never goes past a stop point, and the deltas of a
    request joined together (with ``flush()``'s) equal its final ``text``.
    ``num_tokens_used`` counts the appended tokens that belong to the output: all of them,
    unless a stop string matched, then those up to and including the token that completed
    it (the engine trims the rest, so appending k tokens at once equals k single appends).
    """

    text_delta: str
    stop_reason: str | None  # the stop string that matched; the request must finish
    num_tokens_used: int


class IncrementalDetokenizer:
    """Detokenizes one request's output as it grows. Not thread-safe; one per request.

    Invariant: ``text`` is a prefix of ``tokenizer.decode(output_ids, skip_special_tokens=
    params.skip_special_tokens)`` (equal to it after ``flush()`` when no stop string
    matched; cut at the stop point when one did), and the concatenated deltas are a prefix
    of ``text``. Stop strings are only looked for once the output has ``min_tokens`` tokens
    (counting the token being appended), matching the engine's rule for stop token ids.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        # A fast tokenizer's Rust core decodes exactly as its decode() without clean-up,
        # minus ~20 µs of Python wrapping a call (two calls per token, every request).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stops: list[str] = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Longest text that may still turn into a stop string once more text arrives.
        self._max_partial_stop = max((len(s) for s in self._stops), default=1) - 1

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends mid-character; output bytes would merge into it. Decode the
            # output on its own instead.
            context, context_text = [], ""
        self._window: list[int] = context  # prefix tokens, then unread tokens
        self._num_prefix = len(context)
        self._prefix_text = context_text

        self._num_output_tokens = 0
        self._streamed: list[str] = []  # deltas already handed out
        self._pending = ""  # decoded text held back: it may start a stop string
        self._recent = ""  # last _max_partial_stop characters of decoded text
        self._stop_reason: str | None = None
        self._done = False

    # ---- public ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """Output text decoded so far (streamed or held back), cut at a matched stop."""
        if len(self._streamed) > 1:
            self._streamed = ["".join(self._streamed)]
        return (self._streamed[0] if self._streamed else "") + self._pending

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @property
    def num_output_tokens(self) -> int:
        """Output tokens appended and used (those after a stop match are not counted)."""
        return self._num_output_tokens

    def append(self, new_token_ids: list[int]) -> DetokenizerUpdate:
        """Add sampled tokens; return the text that is now safe to stream."""
        if self._done:
            raise RuntimeError(
                "append() after the request finished "
                f"(stop_reason={self._stop_reason!r}); start a new detokenizer per request"
            )
        deltas: list[str] = []
        for used, token_id in enumerate(new_token_ids, start=1):
            self._num_output_tokens += 1
            deltas.append(self._consume(self._decode_token(token_id)))
            if self._stop_reason is not None:
                self._done = True
                return DetokenizerUpdate("".join(deltas), self._stop_reason, used)
        return DetokenizerUpdate("".join(deltas), None, len(new_token_ids))

    def flush(self) -> str:
        """Finish the request (EOS, stop token id, length, abort): release every held
        character and return that last delta. Returns "" after a stop-string match."""
        if self._done:
            return ""
        self._done = True
        delta = ""
        if len(self._window) > self._num_prefix:
            delta = self._consume(self._release())
        if self._stop_reason is None:
            delta += self._pending
            self._streamed.append(self._pending)
            self._pending = ""
        return delta

    # ---- tokens to text ----------------------------------------------------------------
    def _decode(self, token_ids: list[int]) -> str:
        # Clean-up of tokenization spaces rewrites text across token boundaries, which no
        # incremental decoder can reproduce; request it off so windows compose exactly.
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_token(self, token_id: int) -> str:
        """Add one token to the window; return the text it completes ("" while held)."""
        self._window.append(token_id)
        num_unread = len(self._window) - self._num_prefix
        if num_unread >= _MAX_UNREAD_TOKENS:
            return self._release()
        full = self._decode(self._window)
        if len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""
        return self._release(full)

    def _release(self, full: str | None = None) -> str:
        """Emit the unread tokens' text and make them the next prefix."""
        if full is None:
            full = self._decode(self._window)
        new_text = full[len(self._prefix_text) :]
        del self._window[: self._num_prefix]
        self._num_prefix = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    # ---- text to deltas (stop strings) -------------------------------------------------
    def _consume(self, new_text: str) -> str:
        """Append newly decoded text; return what can be streamed. Sets ``_stop_reason``."""
        if not new_text:
            return ""
        if self._stops and self._num_output_tokens >= self._min_tokens:
            delta = self._cut_at_stop(new_text)
            if delta is not None:
                return delta
        buffer = self._pending + new_text
        hold = self._partial_stop_len(buffer)
        delta = buffer[: len(buffer) - hold]
        self._pending = buffer[len(buffer) - hold :]
        self._streamed.append(delta)
        if self._max_partial_stop:
            self._recent = (self._recent + new_text)[-self._max_partial_stop :]
        return delta

    def _cut_at_stop(self, new_text: str) -> str | None:
        """If a stop string ends inside ``new_text``, finish the text there and return the
        last delta; otherwise None. Of several matches the one that ends first wins (the
        first a character-by-character reader would see), then the one starting first."""
        window = self._recent + new_text
        new_start = len(self._recent)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # Occurrences ending before new_text were checked on earlier calls.
            start = window.find(stop, max(0, new_start - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        end, start, stop = best
        # Held-back text always covers a match that began before new_text (see
        # _partial_stop_len), so the cut never falls inside text already streamed.
        pending_start = new_start - len(self._pending)
        assert start >= pending_start, "stop match reaches into streamed text"
        delta = window[pending_start : end if self._include_stop else start]
        self._streamed.append(delta)
        self._pending = ""
        self._stop_reason = stop
        return delta

    def _partial_stop_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop
        string. Holding exactly that much back is enough: any later match that starts
        earlier would make a longer such suffix."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
