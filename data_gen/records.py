"""The unit every stage passes along: a conversation with an id, and the bookkeeping of
records that were skipped.

A conversation is a list of ``{"role", "content"}`` messages with roles ``system`` (first
message only), ``user`` and ``assistant``. Stored as one JSON object per line::

    {"id": "chatterbot/english/ai#3", "source": "chatterbot", "conversations": [...]}

after regeneration also ``"input_ids"`` and ``"loss_mask"`` (lists of ints, same length).
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names → chat roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


class BadRecord(ValueError):
    """A record that cannot be used; ``reason`` is the counter key it is skipped under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Conversation:
    """A conversation to (re)generate. ``messages`` are validated: roles in ``ROLES``, a
    system message only first, at least one non-empty user message."""

    id: str
    messages: tuple[dict[str, str], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.messages:
            raise BadRecord("empty", f"record {self.id!r} has no messages")
        for i, m in enumerate(self.messages):
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise BadRecord("bad_message", f"record {self.id!r} message {i}: {m!r:.80}")
            if m["role"] == "system" and i != 0:
                raise BadRecord("bad_message", f"record {self.id!r}: system message at {i}")
        if not any(m["role"] == "user" and m["content"].strip() for m in self.messages):
            raise BadRecord("empty", f"record {self.id!r} has no non-empty user message")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "conversations": list(self.messages)}

    @property
    def prompt_text(self) -> str:
        """The system and user turns: what identifies the conversation for deduplication
        (assistant turns are regenerated anyway)."""
        return "\n".join(m["content"] for m in self.messages if m["role"] != "assistant")


def parse_conversation(obj: Any, default_id: str, source: str = "") -> Conversation:
    """A ShareGPT (``conversations`` of from/value or role/content), OpenAI-style
    (``messages``) or plain (``prompt``, optional ``system``) record → ``Conversation``.
    Raises ``BadRecord`` with a counter reason."""
    if not isinstance(obj, dict):
        raise BadRecord("bad_structure", f"{default_id}: not a JSON object")
    rid = str(obj.get("id", default_id))
    source = str(obj.get("source", source))
    turns = obj.get("conversations", obj.get("messages"))
    if turns is None:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise BadRecord("bad_structure", f"{rid}: no conversations, messages or prompt")
        msgs = [{"role": "user", "content": prompt}]
        if isinstance(obj.get("system"), str):
            msgs.insert(0, {"role": "system", "content": obj["system"]})
        return Conversation(rid, tuple(msgs), source)
    if not isinstance(turns, list):
        raise BadRecord("bad_structure", f"{rid}: conversations is not a list")
    msgs = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRecord("bad_message", f"{rid}: turn {turn!r:.60} is not an object")
        speaker = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None or not isinstance(content, str):
            raise BadRecord("bad_message", f"{rid}: turn from {speaker!r} is not usable")
        msgs.append({"role": role, "content": content})
    return Conversation(rid, tuple(msgs), source)


_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed: what counts as "the same prompt"."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_hash(text: str) -> str:
    return hashlib.sha1(normalize_text(text).encode()).hexdigest()


@dataclass
class SkipCounts:
    """Records skipped, by reason (``empty``, ``bad_json``, ``too_long``, ...)."""

    counts: Counter = field(default_factory=Counter)

    def add(self, reason: str, n: int = 1) -> None:
        self.counts[reason] += n

    def as_dict(self, prefix: str = "skipped_") -> dict[str, int]:
        return {f"{prefix}{k}": v for k, v in sorted(self.counts.items())}

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def dumps_record(obj: dict[str, Any]) -> str:
    """One JSONL line; key order and separators fixed so equal records give equal bytes."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
