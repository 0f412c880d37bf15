"""Relay of a gen server's SSE stream to the client, with cleanup on every way it can end.

The stream ends in one of three ways: the gen server finishes (``data: [DONE]``), the upstream
breaks (the client gets an SSE error event and ``[DONE]``, never a hang), or the client goes away
(the upstream response is closed, which makes the gen server abort). Whatever happened,
:meth:`StreamRelay.close` runs once: it closes the upstream, drops the in-flight count, records
latency metrics and, unless the gen server finished, asks the ctx server to release the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from pdserve.protocol import SSE_DONE

from .h1client import UpstreamError
from .metrics import Metrics
from .pools import Server
from .sse import error_events
from .upstream import OpenStream, describe

log = logging.getLogger("orchestrator.relay")


_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class StreamRelay:
    """Owns one open gen stream until :meth:`close`; ``await relay(scope, receive, send)`` is the
    client's SSE response (an ASGI callable that never reads ``receive``).

    ``on_abandon`` is called (once, from :meth:`close`) when the stream did not finish cleanly.
    ``deadline_s`` is a ``time.monotonic()`` instant after which the upstream is cut (one timer per
    stream, not one timeout per chunk).
    """

    status_code = 200

    def __init__(self, stream: OpenStream, server: Server, endpoint: str, started_s: float, deadline_s: float,
                 metrics: Metrics, on_abandon: Callable[[], None]) -> None:
        self._stream = stream
        self._server = server
        self._endpoint = endpoint
        self._started_s = started_s
        self._deadline_s = deadline_s
        self._metrics = metrics
        self._itl = metrics.child(metrics.itl, endpoint)
        self._on_abandon = on_abandon
        self._finished = False
        self._closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timer = asyncio.get_running_loop().call_later(max(self._deadline_s - time.monotonic(), 0.0),
                                                      self._stream.expire)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": list(_SSE_HEADERS)})
            await self._pump(send)
        finally:
            timer.cancel()
            self.close()

    async def _pump(self, send: Send) -> None:
        """Upstream chunks to the client as they come; an error event if the stream broke.

        The chunk after which the upstream has ended (``[DONE]`` read, message complete) goes out
        as the last body message: one write to the client instead of two.
        """
        t_first = t_prev = time.monotonic()
        self._metrics.child(self._metrics.ttft, self._endpoint).observe(t_first - self._started_s)
        chunk, tail, chunks = self._stream.first_chunk, b"", 0
        while True:
            tail = (tail + chunk)[-len(SSE_DONE):]
            chunks += 1
            last = tail == SSE_DONE and self._stream.ended()
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                break
            try:
                chunk = await self._stream.next_chunk()
            except UpstreamError as err:
                await self._send_broken(send, tail, f"generation stream from {self._server.url} broke: {describe(err)}")
                return
            if chunk is None:
                if tail != SSE_DONE:
                    await self._send_broken(send, tail, f"generation stream from {self._server.url} ended without [DONE]")
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                break
            now = time.monotonic()
            self._itl.observe(now - t_prev)
            t_prev = now
        self._finished = True
        if chunks > 1:
            self._metrics.child(self._metrics.tpot, self._endpoint).observe((t_prev - t_first) / (chunks - 1))

    async def _send_broken(self, send: Send, tail: bytes, message: str) -> None:
        events = self._broken(tail, message)
        await send({"type": "http.response.body", "body": b"".join(events), "more_body": False})

    def _broken(self, tail: bytes, message: str) -> list[bytes]:
        log.warning("%s", message)
        self._server.mark_unhealthy(message)
        self._metrics.errors.labels(kind="gen_stream").inc()
        # Terminate a half-written event so the error event parses on its own.
        prefix = [] if tail.endswith(b"\n\n") or not tail else [b"\n\n"]
        return prefix + error_events(message)

    def close(self) -> None:
        """Idempotent cleanup; never awaits, so it also runs inside a cancelled task."""
        if self._closed:
            return
        self._closed = True
        self._server.in_flight -= 1
        self._stream.close()  # before [DONE] this is what aborts the gen request
        self._metrics.child(self._metrics.e2e, self._endpoint).observe(time.monotonic() - self._started_s)
        if not self._finished:
            self._on_abandon()

