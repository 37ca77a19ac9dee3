"""OpenAI request bodies → engine inputs: prompt token ids and ``SamplingParams``.

Prompts are tokenized exactly as the offline ``LLM`` does (``encode`` without special
tokens for text; the tokenizer's chat template with the generation prompt for chats), so
a request's tokens, and so its greedy output, equal ``LLM.generate``/``LLM.chat``'s.
Every client mistake raises ``APIError(400)`` naming the field and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from specdec.sampling_params import SamplingParams
from specdec.serve.errors import APIError
from specdec.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    SpecExitBody,
)
from specdec.spec_exit_params import SpecExitParams, spec_exit_params

logger = logging.getLogger(__name__)


def completion_prompt_ids(tokenizer, prompt: str | list) -> list[int]:
    """One prompt's ids (``completion_prompt``'s text encoded here, on the caller's
    thread); a batch of several is refused."""
    prompt = completion_prompt(prompt)
    if isinstance(prompt, list):
        return prompt
    try:
        return tokenizer.encode(prompt, add_special_tokens=False)
    except (ValueError, TypeError) as e:  # e.g. lone surrogates the tokenizer cannot take
        raise APIError(400, f"prompt cannot be tokenized: {e}", param="prompt") from None


def completion_prompt(prompt: str | list) -> str | list[int]:
    """One prompt as its text or its token ids (range is the engine's check: it names the
    vocabulary); a batch of several is refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"prompt holds {len(prompt)} prompts; this server takes one prompt per "
                "request (send the others as separate, concurrent requests)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return prompt


def chat_prompt_text(tokenizer, body: ChatCompletionRequest) -> str:
    """The conversation rendered with the tokenizer's chat template (special tokens
    written as text); ``chat_prompt_ids`` encodes it, the server's ``PromptEncoder``
    encodes it off the event loop."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            400, "this model has no chat template; use /v1/completions with a plain prompt"
        )
    conversation = [
        {
            "role": m.role,
            # Text parts join with newlines, as vLLM does.
            "content": m.content
            if isinstance(m.content, str)
            else "\n".join(p.text for p in m.content),
        }
        for m in body.messages
    ]
    try:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except (TemplateError, ValueError, TypeError) as e:
        raise APIError(400, f"messages cannot be rendered: {e}", param="messages") from None


def chat_prompt_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The conversation rendered with the tokenizer's chat template, as token ids: the
    rendered text encoded without special tokens added (the template writes its own),
    which is what ``apply_chat_template(tokenize=True)`` (the offline ``LLM.chat``) gives."""
    text = chat_prompt_text(tokenizer, body)
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except (ValueError, TypeError) as e:
        raise APIError(400, f"messages cannot be tokenized: {e}", param="messages") from None


def refuse_unsupported(body: SamplingFields) -> None:
    """OpenAI parameters specdec does not implement are errors, not silent no-ops."""
    if body.n != 1:
        raise APIError(
            400,
            f"n={body.n} is not supported; this server returns one choice per request "
            "(send n separate requests, with different seeds when sampling)",
            param="n",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported; leave it out or pass 0", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported; leave it out", param="logit_bias")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise APIError(400, "echo is not supported; leave it out or pass false", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported; leave it out", param="suffix")
        if body.best_of not in (None, 1):
            raise APIError(400, f"best_of={body.best_of} is not supported; use 1", param="best_of")
    else:
        if body.tools or body.tool_choice not in (None, "none"):
            raise APIError(400, "tool calling is not supported; leave out tools", param="tools")
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(
                400,
                f"response_format type {body.response_format.type!r} is not supported; "
                "only 'text' is",
                param="response_format",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.model_extra:
        logger.warning("ignoring unknown request fields %s", sorted(body.model_extra))


def resolve_max_tokens(
    asked: int | None,
    default: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    limit: int | None,
) -> int | None:
    """The request's max_tokens: ``asked`` (checked against the server's limit), else
    ``default`` (the endpoint's: 16 for completions, the context for chat) capped by the
    limit. None lets the engine generate until the context is full."""
    if asked is not None:
        if limit is not None and asked > limit:
            raise APIError(
                400,
                f"max_tokens={asked:,} exceeds this server's limit {limit:,} "
                "(max_tokens_limit); lower it",
                param="max_tokens",
            )
        return asked
    if limit is None:
        return default
    if default is None:
        return max(1, min(limit, max_model_len - num_prompt_tokens))
    return min(default, limit)


def resolve_spec_exit(
    asked: bool | SpecExitBody | None,
    base: Sequence[dict[str, Any] | None],
    by_default: bool,
) -> SpecExitParams | None:
    """A request's SpecExit settings: ``base`` holds the partial settings under the
    request's, lowest precedence first (the head's record, then the server's); ``true``
    takes them, an object overrides them field by field (``spec_exit_params``), ``false``
    opts out, absent follows ``by_default``."""
    if asked is None:
        asked = by_default
    if asked is False:
        return None
    fields = {} if asked is True else asked.model_dump(exclude_unset=True)
    try:
        return spec_exit_params(*base, fields)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="spec_exit") from None


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    spec_exit: SpecExitParams | None = None,
) -> SamplingParams:
    """The engine's params for a request; its own validation errors become 400s."""
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            speculate=body.speculate,
            spec_exit=spec_exit,
        )
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
