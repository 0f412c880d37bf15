"""Noticing at once that an HTTP client has gone, so that its request leaves the engine at once.

A request's work runs as a task; :func:`unless_client_leaves` races it against the ASGI
``http.disconnect`` message. Once the request body has been read, the server's ``receive()``
blocks until the client disconnects (uvicorn: the connection is lost; the ASGI spec's
``http.disconnect`` event), so the wait is event-driven: no polling interval sits between the
client leaving and the abort reaching the engine (which then drops the request from its waiting
queue, or from a running prefill, at the next step boundary).
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request

UNEXPECTED_MESSAGE_PAUSE_S = 0.25  # a receive() that returns something else is retried this often


async def client_gone(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read already) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(UNEXPECTED_MESSAGE_PAUSE_S)  # e.g. an empty trailing body chunk: never spin


async def unless_client_leaves(work: asyncio.Task, request: Request) -> bool:
    """Wait until ``work`` is done or the client has left. True when the client left first (``work``
    is then still running: the caller cancels it and aborts the request); False when ``work`` is
    done (its result or exception is left in the task)."""
    gone = asyncio.create_task(client_gone(request), name="client-gone")
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        return not work.done()
    finally:
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
