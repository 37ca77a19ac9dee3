"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right
status. Client mistakes are 4xx with a message that names the bad value; anything
unexpected is logged with its traceback and answered with a generic 500 that carries none.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the client should see as is."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    # ensure_ascii: a message may quote client text, and a lone surrogate in it would
    # fail a UTF-8 encode (a 500) if written raw.
    body = json.dumps(error_body(status_code, message, param, code))
    return Response(body, status_code, headers=headers, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's errors as one line each: ``messages.0.role: Input should be ...``."""
    parts, first_param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":  # loc holds the character offset
            ctx = err.get("ctx") or {}
            at = f" at character {loc[0]}" if loc else ""
            parts.append(f"the body is not valid JSON{at} ({ctx.get('error', 'parse error')})")
            param = None
        else:
            parts.append(f"{param}: {err.get('msg')}" if param else str(err.get("msg")))
        first_param = first_param or param
    return "; ".join(parts) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(
            exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error; the server log has the details")
