"""Request and response bodies of the OpenAI API, as pydantic models (the HTTP edge).

Shapes follow OpenAI's completions and chat.completions APIs so the official clients work
unchanged; a few vLLM extensions (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``) are accepted too, and specdec's own ``speculate`` (false: this request
decodes without speculation) and ``spec_exit`` (SpecExit opt-in, docs/spec_exit.md:
``true``, or an object overriding the server's settings). Bounds that
the engine would otherwise reject deep inside a step (``top_k`` fits int64, ``logprobs``
<= 20, finite floats) are enforced here, so a request body can never reach the engine in a
state that would fail a whole batch.

Request models allow unknown fields (OpenAI adds parameters often; like vLLM, the server
ignores ones it does not know and logs them). Parameters that OpenAI defines but specdec
does not implement (``n > 1``, ``echo``, penalties, tools, ...) are refused with a 400 by
the handlers rather than silently ignored.

The bodies of vLLM's /tokenize and /detokenize routes (serve/tokenize.py) close the file.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer

from specdec.sampling_params import MAX_LOGPROBS

_INT64_MAX = 2**63 - 1
# A think marker given as token ids (SpecExit; docs/spec_exit.md).
_MarkerIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=64)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False  # one last chunk with usage and no choices


class SpecExitBody(BaseModel):
    """A request's SpecExit overrides (``SpecExitParams`` fields; unset ones keep the
    server's, else the draft head's recorded ones, else the library defaults). Unknown keys
    are errors: a typo must not silently change the policy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    confidence_above: float | None = None
    progress_above: float | None = None
    remaining_below: float | None = None
    smoothing: str | None = None
    alpha: float | None = None
    beta: float | None = None
    window: int | None = None
    think_start: str | _MarkerIds | None = None  # text (any number of tokens) or ids
    think_end: str | _MarkerIds | None = None
    delimiters: Annotated[list[str], Field(min_length=1, max_length=16)] | None = None


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="a served model name; default: the first")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(
        None, description="0 is greedy; default 1"
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = Field(
        None, description="keep the k most likely tokens; 0 or -1 disables (vLLM extension)"
    )
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT64_MAX)]] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    speculate: bool = Field(
        True, description="false: decode this request without speculation (specdec extension)"
    )
    spec_exit: bool | SpecExitBody | None = Field(
        None,
        description="SpecExit: true, false, or settings overriding the server's, which "
        "override the draft head's recorded ones (default: the server's choice)",
    )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="one prompt: a string or a list of token ids"
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        16, description="default 16; null: until the context is full"
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="top logprobs per token (0 returns only the sampled token's)"
    )
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="deprecated OpenAI name of max_completion_tokens"
    )
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    response_format: ResponseFormat | None = None


# Request examples for /docs (OpenAPI ``examples``; API fuzzers replay them as known-good
# bodies). Short answers: they fit a server's tightest max_tokens limits.
COMPLETION_EXAMPLES = {
    "greedy": {
        "summary": "greedy completion",
        "value": {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
    },
}
CHAT_EXAMPLES = {
    "greedy": {
        "summary": "greedy chat",
        "value": {
            "messages": [{"role": "user", "content": "Name a prime number."}],
            "max_tokens": 4,
            "temperature": 0,
        },
    },
}


# ---- responses ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class SpecExitUsage(BaseModel):
    exits: int  # times thinking was cut short
    think_tokens_saved_estimate: float  # the draft head's remaining-tokens signal at exits


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_exit: SpecExitUsage | None = None  # requests that opted into SpecExit only

    @model_serializer(mode="wrap")
    def _drop_spec_exit_unless_set(self, handler):
        out = handler(self)
        if out.get("spec_exit") is None:
            out.pop("spec_exit", None)
        return out


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specdec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy per-token logprobs (parallel lists, one entry per output token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    """Also the shape of a streamed chunk (then ``usage`` is None but on the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """What a chat chunk adds; fields it does not set are left out, as OpenAI does
    (the first chunk has the role, the last one an empty delta)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- /tokenize and /detokenize (vLLM's extension routes) ---------------------------------


class TokenizeCompletionRequest(_Request):
    model: str | None = Field(None, description="a served model name; default: the first")
    prompt: str
    add_special_tokens: bool = Field(
        True, description="wrap the ids in the tokenizer's special tokens (e.g. BOS)"
    )
    return_token_strs: bool | None = Field(False, description="also return each id's token string")


class TokenizeChatRequest(_Request):
    """Tokenized exactly as /v1/chat/completions tokenizes the same ``messages``."""

    model: str | None = Field(None, description="a served model name; default: the first")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    # vLLM's chat-only fields: accepted so its clients validate; values this server
    # cannot honour are refused by the handler instead of silently changing the ids.
    continue_final_message: bool = False
    add_special_tokens: bool = Field(
        False, description="add the tokenizer's special tokens on top of the chat template's"
    )
    return_token_strs: bool | None = Field(False, description="also return each id's token string")
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


def _tokenize_kind(body: Any) -> str | None:
    """The union member a body is: chat with ``messages``, completion with a ``prompt``;
    None (the union's error) for a body with neither."""
    if isinstance(body, dict):
        keys = body.keys()
    else:  # an already-built model
        keys = {k for k in ("messages", "prompt") if hasattr(body, k)}
    if "messages" in keys:
        return "chat"
    return "completion" if "prompt" in keys else None


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")]
    | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(
        _tokenize_kind,
        custom_error_type="tokenize_input",
        custom_error_message="pass either prompt (text) or messages (a chat)",
    ),
]


class TokenizeResponse(BaseModel):
    count: int  # len(tokens)
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only when return_token_strs


class DetokenizeRequest(_Request):
    model: str | None = Field(None, description="a served model name; default: the first")
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


TOKENIZE_EXAMPLES = {
    "prompt": {
        "summary": "a plain prompt",
        "value": {"prompt": "The capital of France is", "return_token_strs": True},
    },
    "chat": {
        "summary": "a chat, as /v1/chat/completions would tokenize it",
        "value": {"messages": [{"role": "user", "content": "Name a prime number."}]},
    },
}
DETOKENIZE_EXAMPLES = {
    "tokens": {"summary": "token ids", "value": {"tokens": [504, 3575, 282, 4649, 314]}},
}
