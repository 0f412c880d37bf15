"""Per-request output streams: an asyncio queue fed from another thread."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class RequestStream:
    """Where one request's outputs go: an asyncio queue living on ``loop``.

    ``put`` is thread-safe (``call_soon_threadsafe``); ``finished`` is set by the consumer once the
    final output or an error was taken, so that closing the stream early can abort the request.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            log.debug("dropping an output for a closed event loop")
