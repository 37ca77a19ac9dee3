"""API-key authentication: ``Authorization: Bearer <key>`` on every /v1 route.

A pure ASGI middleware rather than a route dependency, so the key is checked before the
body is parsed: an unauthenticated client gets 401 whatever it sent, never a 400 that
reveals how its body was read. /health, /metrics and the docs stay open (probes and
scrapers), as in vLLM.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from specdec.serve.errors import error_response

PROTECTED_PREFIX = "/v1"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # The scheme is case-insensitive; the key is compared in constant time.
        scheme, _, key = given.partition(b" ")
        if hmac.compare_digest(scheme.lower() + b" " + key.strip(), self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key; send the header 'Authorization: Bearer <key>'"
            if not given
            else "invalid API key"
        )
        response = error_response(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)
