"""The request id: taken from the client's ``X-Request-Id`` (or made), sent to every server, echoed
to the client, and stamped on every log line written while the request is handled.

The id lives in a :class:`contextvars.ContextVar`, so tasks spawned for a request (a lease
release) carry it too; :class:`RequestIdFilter` copies it into each ``LogRecord`` as
``request_id`` (``-`` outside a request) for a format such as ``%(request_id)s``.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

HEADER = b"x-request-id"
MAX_LEN = 128
_SAFE = re.compile(rb"^[A-Za-z0-9._:@/+=-]+$")  # printable, no spaces: safe in a header and a log line

current: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)


def from_headers(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is 1..128 safe characters, else a new ``req-<hex>``."""
    for name, value in headers:
        if name == HEADER:
            if 0 < len(value) <= MAX_LEN and _SAFE.match(value):
                return value.decode("ascii")
            break
    return f"req-{uuid.uuid4().hex}"


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the current request's id, or ``-``). Attach to handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current.get() or "-"
        return True


def install_log_filter(fmt: str = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s") -> None:
    """Put the filter and a format naming the request id on every root handler."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter(fmt))
