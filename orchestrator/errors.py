"""Errors the orchestrator answers with, each rendered as an OpenAI-style error body."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pdserve.protocol import error_body

from .responses import JSONAnswer

# OpenAI error ``type`` per HTTP status family.
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


def error_type(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "internal_server_error"


class OrchestratorError(Exception):
    """A request the orchestrator answers with an error.

    Attributes:
        status: HTTP status code.
        message: human-readable message (what failed and, where useful, what to do).
        code: OpenAI ``code`` field (defaults to ``status``).
        param: the request field at fault, if any.
        kind: a short label for the ``errors_total{kind}`` metric.
        headers: extra response headers, e.g. ``(("Retry-After", "1"),)``.
        close_connection: answer with ``Connection: close`` (a 413 left the body unread).
    """

    def __init__(self, status: int, message: str, *, code: int | str | None = None,
                 param: str | None = None, kind: str = "request", type_: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = status if code is None else code
        self.param = param
        self.kind = kind
        self.type_ = type_ or error_type(status)
        self.headers = headers
        self.close_connection = False

    def body(self) -> dict:
        return error_body(self.message, self.type_, self.code, self.param)  # type: ignore[arg-type]

    def response(self) -> JSONResponse:
        headers = {**dict(self.headers), **({"connection": "close"} if self.close_connection else {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def answer(self) -> JSONAnswer:
        """The same error as a hot-path ASGI answer."""
        extra = (("Connection", "close"),) if self.close_connection else ()
        return JSONAnswer(self.body(), self.status, (*self.headers, *extra))


class UpstreamRejected(OrchestratorError):
    """A server answered 4xx: its status and body go to the client as they are (no retry)."""

    def __init__(self, status: int, body: dict, phase: str) -> None:
        info = body.get("error") if isinstance(body.get("error"), dict) else {}
        super().__init__(status, str(info.get("message", body)), kind=f"{phase}_rejected")
        self.upstream_body = body

    def body(self) -> dict:
        return self.upstream_body


def error_response(status: int, message: str, *, code: int | str | None = None,
                   param: str | None = None) -> JSONResponse:
    """A JSONResponse with an OpenAI-style error body."""
    return OrchestratorError(status, message, code=code, param=param).response()
