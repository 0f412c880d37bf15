"""Per-request output streams (an asyncio queue fed from another thread) and their registry."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.engine_client import EngineState

log = logging.getLogger(__name__)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None (public API: get_running_loop raises there)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass
class RequestStream:
    """Where one request's outputs go: an asyncio queue living on ``loop``.

    ``put`` is thread-safe (``call_soon_threadsafe`` from another thread; in ``loop``'s own thread
    the item is queued at once, no wake-up); ``finished`` is set by the consumer once the final
    output or an error was taken, so that closing the stream early can abort the request.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put(self, item: object) -> None:
        if _running_loop() is self.loop:  # the lane reader runs in this loop (executor.lattice_client)
            self.queue.put_nowait(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            log.debug("dropping an output for a closed event loop")


class StreamRegistry:
    """The in-flight requests of one engine client and its admission state (thread-safe).

    One lock guards the streams, the state and the death reason: a submit checks the state and
    registers its stream under the lock that :meth:`die` also takes, so a request is either refused
    or registered before ``die`` fails every registered stream — no request can wait forever on a
    dead engine.
    """

    def __init__(self, state: "EngineState") -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self.state = state
        self.dead_reason: str | None = None

    def register(self, request_id: str) -> RequestStream:
        """A stream for a new request. Raises EngineDeadError / EngineNotServingError / ValueError."""
        from executor.engine_client import EngineDeadError, EngineNotServingError, EngineState

        stream = RequestStream(loop=asyncio.get_running_loop())
        with self._lock:
            if self.state == EngineState.DEAD:
                raise EngineDeadError(f"engine is dead: {self.dead_reason}")
            if self.state != EngineState.SERVING:
                raise EngineNotServingError(f"engine is {self.state.value}; not admitting new requests")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        return stream

    def get(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.get(request_id)

    async def consume(self, request_id: str, stream: RequestStream, abort) -> AsyncIterator[object]:
        """Yield a request's items until its finished output; an exception item is raised. Leaving
        early (the consumer closed the iterator) calls ``abort(request_id)``."""
        from engine.request import RequestOutput

        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if isinstance(item, RequestOutput) and item.finished:
                    stream.finished = True
                    yield item
                    return
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not stream.finished:
                abort(request_id)

    def transition(self, old: "EngineState", new: "EngineState") -> None:
        """``old`` → ``new`` if the state is ``old`` (e.g. serving → draining)."""
        with self._lock:
            if self.state == old:
                self.state = new

    def die(self, reason: str, log_error: bool = True) -> None:
        """Dead for good (sticky): fail every pending request with EngineDeadError."""
        from executor.engine_client import EngineDeadError, EngineState

        with self._lock:
            if self.state != EngineState.DEAD:
                self.state = EngineState.DEAD
                self.dead_reason = reason
                if log_error:
                    log.error("engine is dead: %s", reason)
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(EngineDeadError(f"engine is dead: {self.dead_reason}"))
