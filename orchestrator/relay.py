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
from collections.abc import AsyncIterator, Callable

from pdserve.protocol import SSE_DONE

from .h1client import UpstreamError
from .metrics import Metrics
from .pools import Server
from .responses import EventStream
from .sse import error_events
from .upstream import OpenStream, describe

log = logging.getLogger("orchestrator.relay")


class StreamRelay:
    """Owns one open gen stream until :meth:`close`.

    ``on_abandon`` is called (once, from :meth:`close`) when the stream did not finish cleanly.
    ``deadline_s`` is a ``time.monotonic()`` instant after which the upstream is cut.
    """

    def __init__(self, stream: OpenStream, server: Server, endpoint: str, started_s: float, deadline_s: float,
                 metrics: Metrics, on_abandon: Callable[[], None]) -> None:
        self._stream = stream
        self._server = server
        self._endpoint = endpoint
        self._started_s = started_s
        self._deadline_s = deadline_s
        self._metrics = metrics
        self._on_abandon = on_abandon
        self._finished = False
        self._closed = False

    async def body(self) -> AsyncIterator[bytes]:
        """The bytes for the client: upstream chunks as they come, then an error event if it broke."""
        t_first = t_prev = time.monotonic()
        self._metrics.ttft.labels(endpoint=self._endpoint).observe(t_first - self._started_s)
        yield self._stream.first_chunk
        tail = self._stream.first_chunk[-len(SSE_DONE):]
        chunks = 1
        try:
            while True:
                remaining = self._deadline_s - time.monotonic()
                async with asyncio.timeout(max(remaining, 0.0)):
                    chunk = await self._stream.next_chunk()
                if chunk is None:
                    break
                now = time.monotonic()
                self._metrics.itl.labels(endpoint=self._endpoint).observe(now - t_prev)
                t_prev, chunks = now, chunks + 1
                yield chunk
                tail = (tail + chunk)[-len(SSE_DONE):]
        except (UpstreamError, TimeoutError) as err:
            reason = "timed out" if isinstance(err, TimeoutError) else describe(err)
            for event in self._broken(tail, f"generation stream from {self._server.url} broke: {reason}"):
                yield event
            return
        if tail != SSE_DONE:
            for event in self._broken(tail, f"generation stream from {self._server.url} ended without [DONE]"):
                yield event
            return
        self._finished = True
        if chunks > 1:
            self._metrics.tpot.labels(endpoint=self._endpoint).observe((t_prev - t_first) / (chunks - 1))

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
        self._metrics.e2e.labels(endpoint=self._endpoint).observe(time.monotonic() - self._started_s)
        if not self._finished:
            self._on_abandon()

    def response(self) -> EventStream:
        """The client's SSE response; it closes the relay however it ends."""
        return EventStream(self.body(), on_close=self.close)
