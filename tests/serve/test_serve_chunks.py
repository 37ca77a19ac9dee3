"""SSE text chunks written from a template parse to the same JSON as the pydantic chunk
they stand for, whatever the text (quotes, escapes, control characters, non-ASCII)."""

from __future__ import annotations

import json

import pytest

from specdec.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from specdec.serve.serving import TextChunk, _sse

TEXTS = ["", " hello", 'say "hi"', "a\\b", "line\nbreak\ttab\r", "\x00\x1f\x7f", "é中😀", "\u2028"]


def _chat(text: str) -> str:
    choice = ChatChunkChoice(index=0, delta=DeltaMessage(content=text))
    return _sse(ChatCompletionChunk(id="chatcmpl-1", model="m", created=7, choices=[choice]))


def _completion(text: str) -> str:
    choice = CompletionChoice(index=0, text=text)
    return _sse(CompletionResponse(id="cmpl-1", model="m", created=7, choices=[choice]))


@pytest.mark.parametrize("render", [_chat, _completion])
def test_template_chunks_equal_the_models_they_stand_for(render):
    chunk = TextChunk(render)
    for text in TEXTS:
        fast, slow = chunk(text), render(text)
        assert fast.startswith("data: ") and fast.endswith("\n\n")
        assert json.loads(fast[6:]) == json.loads(slow[6:]), text


def test_a_render_that_does_not_hold_the_text_verbatim_is_refused():
    with pytest.raises(ValueError, match="does not hold its text verbatim"):
        TextChunk(lambda text: _chat(text.upper()))
