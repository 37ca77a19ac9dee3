"""Conversations → token ids and the loss mask over exactly the assistant tokens, for any
chat template.

The template is treated as a black box and probed by rendering prefixes: for assistant
message ``i``, rendering ``messages[:i]`` with the generation prompt gives the text that
precedes the reply, and rendering ``messages[:i+1]`` gives the text through the reply's
end-of-turn marker. The characters between the two (trailing whitespace dropped: it is
template glue after the end-of-turn token, not something the model generates) are the
assistant span. The rendering is tokenised piece by piece — text before a span, the span,
text after it — so no token straddles a boundary, just as at generation time, when the
prompt ends at the generation prompt and the answer's tokens follow.

Invariants (tested for ChatML and Llama-3 templates): the masked tokens of turn ``i``
decode to the reply's content followed by the template's end-of-turn token; nothing of the
system prompt, the user turns or the assistant headers is masked; the number of masked
runs equals the number of assistant messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.data_gen.records import BadRecord


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]  # [num_tokens]
    loss_mask: list[int]  # [num_tokens], 1 on assistant tokens


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def check_chat_template(tokenizer, model: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"model {model!r} has no chat template; pass --chat-template FILE (a Jinja "
            "template) to regenerate conversations with it"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"model {model!r} has a slow (Python) tokenizer; the loss mask needs character "
            "offsets, which only fast tokenizers give: save a tokenizer.json for it"
        )


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the ``[start, end)`` character span of every assistant
    reply in it. Raises ``BadRecord("template_mismatch")`` if the template renders a
    prefix differently from the start of the whole (e.g. it rewrites earlier turns)."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise BadRecord(
                "template_mismatch",
                f"the chat template renders turn {i} differently inside the whole "
                "conversation; its loss mask cannot be located by prefixes",
            )
        end = len(through.rstrip())
        if end <= len(before):  # an empty reply without an end-of-turn token
            end = len(through)
        spans.append((len(before), end))
    return full, spans


def tokenize_conversation(
    tokenizer,
    messages: list[dict[str, str]],
    emitted: list[list[int]] | None = None,
) -> TokenizedConversation:
    """Token ids of the rendered conversation and its assistant loss mask (module doc).

    ``emitted``: per assistant message, the token ids the model generated for it (a
    regenerated answer). A reply's span then takes those ids wherever they decode to
    the span's start (the rest, e.g. an end-of-turn marker after a length cut, is
    encoded): the text of an answer re-encoded can tokenise differently from how the
    model wrote it, and a draft head must learn the model's own sequences. Ids that do
    not decode to the span are ignored (the span is encoded)."""
    full, spans = assistant_spans(tokenizer, messages)
    if emitted is not None and len(emitted) != len(spans):
        raise ValueError(
            f"emitted holds {len(emitted)} token lists for {len(spans)} assistant messages; "
            "pass one per assistant message, in order"
        )
    bounds = [0, *(b for span in spans for b in span), len(full)]
    ids: list[int] = []
    mask: list[int] = []
    for k in range(len(bounds) - 1):
        segment = full[bounds[k] : bounds[k + 1]]
        seg_ids = None
        if emitted is not None and k % 2:
            seg_ids = _from_emitted(tokenizer, segment, emitted[k // 2])
        if seg_ids is None:
            seg_ids = tokenizer.encode(segment, add_special_tokens=False) if segment else []
            if tokenizer.decode(seg_ids) != segment:
                return _tokenize_by_offsets(tokenizer, full, spans)
        ids += seg_ids
        mask += [k % 2] * len(seg_ids)  # odd segments are the assistant spans
    return TokenizedConversation(ids, mask)


def _from_emitted(tokenizer, segment: str, emitted: list[int]) -> list[int] | None:
    """``emitted`` plus the encoded rest of ``segment`` when ``emitted`` decodes to its
    start; None otherwise."""
    text = tokenizer.decode(emitted)
    if not segment.startswith(text):
        return None
    rest = segment[len(text) :]
    rest_ids = tokenizer.encode(rest, add_special_tokens=False) if rest else []
    if tokenizer.decode(rest_ids) != rest:
        return None
    return [*emitted, *rest_ids]


def _tokenize_by_offsets(tokenizer, full: str, spans: list[tuple[int, int]]):
    """Fallback for tokenizers that do not tokenise a piece as it reads (SentencePiece
    adds a leading space): one tokenisation of the whole text, and a token is masked iff
    its characters overlap an assistant span."""
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(start < b and end > a for a, b in spans)) for start, end in enc["offset_mapping"]
    ]
    return TokenizedConversation(list(enc["input_ids"]), mask)
