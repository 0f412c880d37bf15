"""Last-resort error boundary for an ASGI app: an unexpected exception becomes an OpenAI 500 body.

Without it, starlette's ``ServerErrorMiddleware`` answers ``Internal Server Error`` as plain text
and re-raises, and uvicorn then closes the connection, so the client's *next* request on the same
keep-alive connection fails too. Here the exception is logged with its traceback, the client gets
``{"error": {...}}`` (status 500, type ``internal_error``) and the connection stays usable. A bug
still shows as a 5xx (the fuzz tests fail on any); this only keeps one bug from costing a second
request. An exception after the response started cannot become a status any more: it is re-raised
(uvicorn closes the connection, which is how the client learns that the body is incomplete).
"""

from __future__ import annotations

import json
import logging

from .protocol import error_body

log = logging.getLogger("pdserve.asgi_guard")


class ErrorBoundary:
    """Pure ASGI middleware; add it outermost (``app.add_middleware(ErrorBoundary)``, added last)."""

    def __init__(self, app, name: str = "app") -> None:
        self.app, self.name = app, name

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch_start(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch_start)
        except Exception as err:  # noqa: BLE001 - the boundary: every failure becomes an error body
            if started:
                raise
            log.exception("%s: unhandled error in %s %s", self.name, scope.get("method"), scope.get("path"))
            body = json.dumps(error_body(f"internal error: {type(err).__name__}", "internal_error", 500)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
