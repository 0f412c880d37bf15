"""The two kinds of answer the OpenAI routes send, as plain ASGI callables (no Starlette on the
hot path): a JSON body, or a server-sent-event stream.

Each has ``status_code`` (for the request metrics) and ``await response(scope, receive, send)``.
Neither reads ``receive``: the front (:mod:`orchestrator.front`) owns the client's disconnects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.types import Receive, Scope, Send

from . import jsonio

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class JSONAnswer:
    """``doc`` (a JSON-able object, or bytes already encoded) with ``status_code``.

    ``headers``: extra ``(name, value)`` string pairs (e.g. ``Retry-After``).
    """

    def __init__(self, doc: object, status_code: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.body = doc if isinstance(doc, bytes) else jsonio.dumps(doc)
        self.status_code = status_code
        self._headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [_JSON, (b"content-length", str(len(self.body)).encode()), *self._headers]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class EventStream:
    """A 200 ``text/event-stream`` of ``chunks`` (already framed SSE bytes).

    ``on_close`` runs exactly once however the stream ends (finished, failed, or cancelled because
    the client left); it must not await, so it also runs inside a cancelled task.
    """

    status_code = 200

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> None:
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": list(_SSE_HEADERS)})
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self._on_close is not None:
                self._on_close()


async def iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    """An async iterator over a list of SSE events (for :class:`EventStream`)."""
    for event in events:
        yield event
