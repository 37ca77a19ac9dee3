"""The FastAPI app (``build_app``) and the uvicorn entry point (``run_server``).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with
``stream: true``), GET /health (200 while the engine loop runs, else 503), GET /metrics
(Prometheus text), POST /tokenize and /detokenize (vLLM's), /docs and /openapi.json. With
an API key every /v1 route needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Body, FastAPI, Request, Security
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from specdec import __version__
from specdec.serve.async_engine import AsyncLLMEngine
from specdec.serve.auth import APIKeyMiddleware
from specdec.serve.config import ServeConfig
from specdec.serve.errors import error_response, install_error_handlers
from specdec.serve.launch import Launch, launch
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import (
    CHAT_EXAMPLES,
    COMPLETION_EXAMPLES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from specdec.serve.serving import OpenAIServing
from specdec.serve.tokenize import tokenize_routes

logger = logging.getLogger(__name__)

_ERRORS = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Malformed JSON, a schema violation, or a request the engine cannot take "
        "(e.g. prompt + max_tokens over the context)",
        401: "Missing or wrong API key",
        404: "Unknown model",
        429: "Too many requests in flight; retry after Retry-After seconds",
        500: "Internal error (details only in the server log)",
        503: "The engine is not running",
    }.items()
}
# Streaming responses: the 200 body is server-sent events of chunks instead.
_STREAM_200 = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def build_app(engine: AsyncLLMEngine, config: ServeConfig) -> FastAPI:
    """An app serving ``engine``; its lifespan starts and stops the engine core."""
    if config.spec_exit_by_default and not engine.info.has_spec_exit:
        raise ValueError(
            "spec_exit_by_default needs an EAGLE-3 draft head with SpecExit channels; this "
            "engine's speculation has none"
        )

    metrics = ServerMetrics(lambda: engine.snapshot)
    engine.add_finish_listener(metrics.observe_finished)
    serving = OpenAIServing(engine, config, engine.tokenizer, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(
        title="specdec",
        version=__version__,
        description="OpenAI-compatible server on specdec's speculative-decoding engine.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    # The middleware checks the key; this only declares the scheme for /docs.
    security = [Security(HTTPBearer(auto_error=False))] if config.api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=security, responses=_ERRORS)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, max_model_len=serving.max_model_len)
                for name in config.model_names
            ]
        )

    @v1.post("/completions", response_model=CompletionResponse, responses=_STREAM_200)
    async def create_completion(
        body: Annotated[CompletionRequest, Body(openapi_examples=COMPLETION_EXAMPLES)],
        raw: Request,
    ):
        return await serving.completions(body, raw)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses=_STREAM_200)
    async def create_chat_completion(
        body: Annotated[ChatCompletionRequest, Body(openapi_examples=CHAT_EXAMPLES)],
        raw: Request,
    ):
        return await serving.chat(body, raw)

    app.include_router(v1)
    app.include_router(tokenize_routes(serving))

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.dead is not None:
            return error_response(503, "the engine loop stopped; restart the server")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 responses: validation errors here are 400s."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def run_server(config: ServeConfig, started: Launch | None = None) -> None:
    """Serve until interrupted (blocks). ``started``: the start-up ``launch(config)``
    began before this module was imported (default: begin it now)."""
    import uvicorn

    from specdec.serve.core_client import InprocCoreClient

    started = started or launch(config)
    try:
        if started.core is not None:
            core = started.core
            # The API side's tokenizer loads while the core loads weights and captures graphs.
            core.wait_ready(on_resolved=started.tokenizer.resolve)
        else:
            from specdec.engine.llm_engine import LLMEngine

            core = InprocCoreClient(LLMEngine(config.core_engine))
    except BaseException:
        started.abort()
        raise
    info = core.info
    started.tokenizer.resolve(info.model)  # no model came before "ready"
    try:
        engine = AsyncLLMEngine(core, config.max_in_flight, started.tokenizer.result())
        app = build_app(engine, config)
    except BaseException:
        core.shutdown()
        raise
    loop, http = http_stack()
    logger.info(
        "serving %s as %s on %s %s (%s), max_model_len %d, %d KV blocks; ready %.1f s after "
        "launch; event loop %s, HTTP parser %s",
        config.engine.model,
        config.model_names,
        info.device,
        info.dtype,
        info.speculation,
        info.max_model_len,
        info.num_kv_blocks,
        started.seconds(),
        loop,
        http,
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=5,
        loop=loop,
        http=http,
    )


def http_stack() -> tuple[str, str]:
    """uvicorn's (event loop, HTTP parser): uvloop and httptools (the serve extra's, C
    implementations) where installed, else asyncio's loop and h11 (pure Python), which
    cost the API process more CPU per streamed chunk (docs/serving.md)."""
    from importlib.util import find_spec

    loop = "uvloop" if find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if find_spec("httptools") is not None else "h11"
    return loop, http
