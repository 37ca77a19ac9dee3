"""Prompt files: one JSON object per line, ``{"prompt": ...}`` or ``{"messages": [...]}``
(OpenAI roles; ShareGPT ``conversations`` also parse), with an optional ``"id"``.

A conversation that ends with assistant turns is cut before them: the bench generates the
reply. Unlike data-gen sources, a bad line is an error naming the file and line, since
a benchmark must run on exactly the prompts the user gave.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from specdec.data_gen.records import BadRecord, Conversation, parse_conversation


def read_prompt_file(path: Path) -> Iterator[Conversation]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                conv = parse_conversation(json.loads(line), f"{path.stem}:{n}", path.stem)
                yield _without_reply(conv)
            except (json.JSONDecodeError, BadRecord) as e:
                raise ValueError(
                    f'{where} is not a {{"prompt": ...}} or {{"messages": [...]}} JSON object ({e})'
                ) from None


def _without_reply(conv: Conversation) -> Conversation:
    messages = list(conv.messages)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return Conversation(conv.id, tuple(messages), conv.source)


def write_prompt_file(path: Path, convs: list[Conversation]) -> None:
    """The inverse of ``read_prompt_file``: ``{"id", "messages"}`` lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"id": c.id, "messages": list(c.messages)}, ensure_ascii=False))
            f.write("\n")
