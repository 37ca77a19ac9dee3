"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` routes, on the server's own tokenizer.

/tokenize answers the ids the generation routes would compute for the same input: a
``prompt`` is tokenized as /v1/completions does (``completion_prompt_ids``), ``messages``
as /v1/chat/completions does (``chat_prompt_ids``); ``add_special_tokens`` then wraps the
ids in the tokenizer's special tokens, as vLLM's encode would (its default is true for a
prompt, false for a chat). /detokenize decodes ids without skipping special tokens, so
``detokenize(tokenize(text))`` gives ``text`` back for text the tokenizer round-trips.

Like vLLM, these routes sit outside /v1 and so outside the API key.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Body

from specdec.serve.errors import APIError
from specdec.serve.inputs import chat_prompt_ids, completion_prompt_ids
from specdec.serve.protocol import (
    DETOKENIZE_EXAMPLES,
    TOKENIZE_EXAMPLES,
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from specdec.serve.serving import OpenAIServing

logger = logging.getLogger(__name__)

_ERRORS = {
    400: {"model": ErrorResponse, "description": "A schema violation or an unknown token id"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
}


def tokenize_routes(serving: OpenAIServing) -> APIRouter:
    """/tokenize and /detokenize for ``serving``'s models and tokenizer.

    The handlers are ``async`` on purpose: they then run on the event loop thread, the
    only thread that uses ``serving.tokenizer`` (HF tokenizers fail under concurrent use).
    """
    tokenizer = serving.tokenizer
    wrapper = special_tokens_around(tokenizer)
    router = APIRouter(responses=_ERRORS)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(
        body: Annotated[TokenizeRequest, Body(openapi_examples=TOKENIZE_EXAMPLES)],
    ) -> TokenizeResponse:
        serving.check_model(body.model)
        _warn_extra(body)
        if isinstance(body, TokenizeChatRequest):
            ids = chat_prompt_ids(tokenizer, _as_chat_completion(body))
        else:
            ids = completion_prompt_ids(tokenizer, body.prompt)
        if body.add_special_tokens:
            if wrapper is None:
                raise APIError(
                    400,
                    "this tokenizer's special tokens do not simply surround a text's ids, so "
                    "they cannot be added here; pass add_special_tokens: false",
                    param="add_special_tokens",
                )
            prefix, suffix = wrapper
            ids = [*prefix, *ids, *suffix]
        return TokenizeResponse(
            count=len(ids),
            max_model_len=serving.max_model_len,
            tokens=ids,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        )

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(
        body: Annotated[DetokenizeRequest, Body(openapi_examples=DETOKENIZE_EXAMPLES)],
    ) -> DetokenizeResponse:
        serving.check_model(body.model)
        _warn_extra(body)
        # HF decodes an unknown id to "" without complaint; a silently shorter text
        # would hide the client's mistake.
        vocab = len(tokenizer)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise APIError(
                    400,
                    f"tokens[{i}] = {token} is outside the vocabulary [0, {vocab}); "
                    "pass ids this model's tokenizer produced",
                    param="tokens",
                )
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    return router


def special_tokens_around(tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids ``tokenizer.encode(text)`` puts before and after the text's own ids (e.g.
    ``([bos], [])``), found by encoding a probe with and without them; None when they do
    not simply surround the text's ids."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return None


def _as_chat_completion(body: TokenizeChatRequest) -> ChatCompletionRequest:
    """The chat request whose prompt ids /tokenize reports; options this server's chat
    route does not take are refused, since ignoring them would change the ids."""
    if body.continue_final_message:
        raise APIError(
            400,
            "continue_final_message is not supported; leave it out or pass false",
            param="continue_final_message",
        )
    for name in ("chat_template", "chat_template_kwargs", "tools"):
        if getattr(body, name):
            raise APIError(
                400,
                f"{name} is not supported; this server renders chats with the model's own "
                "template only (leave it out)",
                param=name,
            )
    return ChatCompletionRequest(
        messages=body.messages, add_generation_prompt=body.add_generation_prompt
    )


def _warn_extra(body: TokenizeCompletionRequest | TokenizeChatRequest | DetokenizeRequest) -> None:
    if body.model_extra:
        logger.warning("ignoring unknown request fields %s", sorted(body.model_extra))
