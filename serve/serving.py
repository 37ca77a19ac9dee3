"""The completions and chat.completions handlers: engine streams → OpenAI responses.

Non-streaming requests race the engine against the client: if the client disconnects
first, the request is aborted. Streaming requests answer with server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``; the response closes its stream
whatever ends it (last chunk sent, client gone, cancellation), which aborts an unfinished
request and frees its KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specdec.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from specdec.serve.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from specdec.serve.config import ServeConfig
from specdec.serve.errors import APIError, error_body
from specdec.serve.inputs import (
    chat_prompt_text,
    completion_prompt,
    refuse_unsupported,
    resolve_max_tokens,
    resolve_spec_exit,
    sampling_params,
)
from specdec.serve.metrics import ServerMetrics
from specdec.serve.prompt_encoder import PromptEncoder
from specdec.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SpecExitUsage,
    TopLogprob,
    Usage,
)
from specdec.spec_exit_params import spec_exit_params

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor.
_MIN_LOGPROB = -9999.0
DONE = "data: [DONE]\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        config: ServeConfig,
        tokenizer,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.config = config
        # The event loop's tokenizer (the streams detokenize with the same one, on the same
        # thread: HF tokenizers must not be used from two threads at once).
        self.tokenizer = tokenizer
        # Prompt texts (rendered chats, completion texts) are encoded off the loop, in
        # batches, on copies of the tokenizer.
        self.encoder = PromptEncoder(
            tokenizer, config.tokenizer_workers, config.tokenizer_max_batch
        )
        self.metrics = metrics
        self.max_model_len = engine.info.max_model_len
        # SpecExit settings under each request's, lowest precedence first: the draft head's
        # record, then the server's (docs/spec_exit.md); checked once here.
        head = engine.info.spec_exit_head_defaults
        self.spec_exit_base = (head, config.spec_exit)
        try:
            spec_exit_params(*self.spec_exit_base)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"the server's spec_exit {config.spec_exit} over the draft head's recorded "
                f"{head}: {e}"
            ) from None

    # ---- shared steps -------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        names = self.config.model_names
        if name is None:
            return names[0]
        if name not in names:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {names}",
                param="model",
                code="model_not_found",
            )
        return name

    async def _start(
        self,
        request_id: str,
        prompt_ids: list[int],
        body,
        max_tokens: tuple[int | None, int | None],
        logprobs: int | None,
        arrival: float,
    ) -> RequestStream:
        """Submit the request; ``max_tokens`` is (asked, the endpoint's default);
        ``arrival``: ``time.monotonic()`` when the handler began (the prompt's encoding
        then counts in its TTFT)."""
        asked, default = max_tokens
        limit = self.config.max_tokens_limit
        resolved = resolve_max_tokens(asked, default, len(prompt_ids), self.max_model_len, limit)
        cfg = self.config
        spec_exit = resolve_spec_exit(body.spec_exit, self.spec_exit_base, cfg.spec_exit_by_default)
        params = sampling_params(body, resolved, logprobs, spec_exit)
        try:
            return await self.engine.add_request(request_id, prompt_ids, params, arrival)
        except QueueFullError as e:
            self.metrics.rejected.labels("queue_full").inc()
            retry = str(self.config.retry_after_s)
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": retry}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        except ValueError as e:  # the engine's validation: prompt/context/KV limits
            raise APIError(400, str(e)) from None

    async def _final_output(self, stream: RequestStream, raw: Request) -> RequestOutput | None:
        """The request's finished output, or None when the client disconnected first (the
        request is then aborted)."""

        async def last() -> RequestOutput | None:
            final = None
            async for out in stream:
                final = out
            return final

        result = asyncio.ensure_future(last())
        gone = asyncio.ensure_future(_client_disconnected(raw))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():  # the client left (or this handler was cancelled)
                result.cancel()
                stream.close()
        if result.cancelled() or not result.done():
            return None
        try:
            return result.result()
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None

    async def _encode(self, text: str, param: str) -> list[int]:
        """``text``'s ids from the prompt encoder (off the event loop); a text the tokenizer
        cannot take (e.g. a lone surrogate) is a 400 naming ``param``."""
        try:
            return await self.encoder.encode(text)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{param} cannot be tokenized: {e}", param=param) from None

    def _usage(self, out: RequestOutput) -> Usage:
        n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        m = out.metrics
        spec_exit = None
        if m.spec_exits is not None:  # the request opted into SpecExit
            saved = m.spec_exit_tokens_saved or 0.0
            spec_exit = SpecExitUsage(exits=m.spec_exits, think_tokens_saved_estimate=saved)
        return Usage(
            prompt_tokens=n_in,
            completion_tokens=n_out,
            total_tokens=n_in + n_out,
            spec_exit=spec_exit,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- /v1/completions ----------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request) -> Response | BaseModel:
        arrival = time.monotonic()
        model = self.check_model(body.model)
        refuse_unsupported(body)
        prompt = completion_prompt(body.prompt)
        prompt_ids = prompt if isinstance(prompt, list) else await self._encode(prompt, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # OpenAI's default of 16 applies when max_tokens is left out; null means no limit.
        asked = body.max_tokens if "max_tokens" in body.model_fields_set else None
        default = None if "max_tokens" in body.model_fields_set else 16
        stream = await self._start(
            request_id, prompt_ids, body, (asked, default), body.logprobs, arrival
        )
        want_logprobs = body.logprobs is not None
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._completion_events(stream, model, want_logprobs, usage)
            return EngineEventStream(events, stream)
        final = await self._final_output(stream, raw)
        if final is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        c = final.outputs[0]
        return CompletionResponse(
            id=request_id,
            model=model,
            choices=[
                CompletionChoice(
                    index=0,
                    text=c.text,
                    logprobs=self._completion_logprobs(c.logprobs or [], 0)
                    if want_logprobs
                    else None,
                    finish_reason=_finish_reason(c),
                )
            ],
            usage=self._usage(final),
        )

    async def _completion_events(
        self, stream: RequestStream, model: str, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            body = CompletionResponse(
                id=stream.request_id, model=model, choices=choices, usage=usage
            )
            return _sse(body)

        text_chunk = TextChunk(lambda text: chunk([CompletionChoice(index=0, text=text)]))
        sent, offset = 0, 0  # tokens whose logprobs went out; their text length
        async for out, error in _guard(stream):
            if error is not None:
                yield error
                break
            c = out.outputs[0]
            logprobs = None
            if want_logprobs:
                logprobs = self._completion_logprobs((c.logprobs or [])[sent:], offset)
                sent = len(c.logprobs or [])
                offset += sum(len(t) for t in logprobs.tokens)
            finish = _finish_reason(c) if out.finished else None
            if logprobs is None and finish is None:
                if out.text_delta:
                    yield text_chunk(out.text_delta)
            elif out.text_delta or finish or (logprobs is not None and logprobs.tokens):
                yield chunk([CompletionChoice(index=0, text=out.text_delta, logprobs=logprobs,
                                              finish_reason=finish)])  # fmt: skip
            if out.finished and include_usage:
                yield chunk([], self._usage(out))
        yield DONE

    def _completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for lp in lps:
            token = self._token_text(lp.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(_clamp(lp.logprob))
            result.top_logprobs.append({self._token_text(t): _clamp(v) for t, v in lp.top.items()})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    # ---- /v1/chat/completions -----------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response | BaseModel:
        arrival = time.monotonic()
        model = self.check_model(body.model)
        refuse_unsupported(body)
        prompt_ids = await self._encode(chat_prompt_text(self.tokenizer, body), "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stream = await self._start(
            request_id, prompt_ids, body, (max_tokens, None), logprobs, arrival
        )
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return EngineEventStream(self._chat_events(stream, model, body.logprobs, usage), stream)
        final = await self._final_output(stream, raw)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(content=c.text),
                    logprobs=self._chat_logprobs(c.logprobs or []) if body.logprobs else None,
                    finish_reason=_finish_reason(c),
                )
            ],
            usage=self._usage(final),
        )

    async def _chat_events(
        self, stream: RequestStream, model: str, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            body = ChatCompletionChunk(
                id=stream.request_id, model=model, choices=choices, usage=usage
            )
            return _sse(body)

        text_chunk = TextChunk(
            lambda text: chunk([ChatChunkChoice(index=0, delta=DeltaMessage(content=text))])
        )
        # The role chunk goes out with the first output, as vLLM's does: clients (vLLM's
        # benchmark among them) time the first token at the first chunk.
        role = chunk([ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
        sent = 0
        async for out, error in _guard(stream):
            if error is not None:
                yield error
                break
            if role:
                yield role
                role = ""
            c = out.outputs[0]
            logprobs = None
            if want_logprobs:
                logprobs = self._chat_logprobs((c.logprobs or [])[sent:])
                sent = len(c.logprobs or [])
            if logprobs is None:
                if out.text_delta:
                    yield text_chunk(out.text_delta)
            elif out.text_delta or logprobs.content:
                delta = DeltaMessage(content=out.text_delta)
                yield chunk([ChatChunkChoice(index=0, delta=delta, logprobs=logprobs)])
            if out.finished:
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=0, delta=DeltaMessage(), finish_reason=_finish_reason(c)
                        )
                    ]
                )
                if include_usage:
                    yield chunk([], self._usage(out))
        yield DONE

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            token = self._token_text(token_id)
            return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode()))

        content = []
        for lp in lps:
            head = entry(lp.token_id, lp.logprob)
            tops = [entry(t, v) for t, v in lp.top.items()]
            content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=tops))
        return ChatLogprobs(content=content)


class EngineEventStream(StreamingResponse):
    """Server-sent events that close their request stream however the response ends, so
    an unfinished request is aborted even if the event generator is never resumed."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def _guard(stream: RequestStream) -> AsyncIterator[tuple[RequestOutput | None, str | None]]:
    """The stream's outputs; an engine failure becomes one SSE error event (the status
    line is already sent, so the error travels in the body as vLLM's does)."""
    try:
        async for out in stream:
            yield out, None
    except EngineDeadError as e:
        yield None, f"data: {json.dumps(error_body(503, str(e), code='engine_unavailable'))}\n\n"


async def _client_disconnected(raw: Request) -> None:
    """Returns once the client has gone (the body is already read, so the next message
    is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _finish_reason(c: CompletionOutput) -> Literal["stop", "length"] | None:
    if c.finish_reason == "length":
        return "length"
    return "stop" if c.finish_reason is not None else None


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


class TextChunk:
    """A stream's SSE chunks that carry only new text (no logprobs, not the last one), the
    bulk of every stream: the event ``render`` makes for a text, written once with a
    placeholder text and split there, then filled with each chunk's text as a JSON string.
    Invariant: ``self(text)`` parses to the same JSON as ``render(text)``; at ~1 µs instead
    of a pydantic model and its serialization per chunk."""

    _PLACEHOLDER = "specdec-text-placeholder"

    def __init__(self, render: Callable[[str], str]) -> None:
        event = render(self._PLACEHOLDER)
        self._head, _, self._tail = event.partition(json.dumps(self._PLACEHOLDER))
        if not self._tail:
            raise ValueError(f"the rendered event {event!r} does not hold its text verbatim")

    def __call__(self, text: str) -> str:
        return f"{self._head}{json.dumps(text, ensure_ascii=False)}{self._tail}"


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"
