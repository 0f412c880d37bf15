"""The request id: taken from the client's ``X-Request-Id`` (or made), sent to every server, echoed
to the client, and stamped on every log line written while the request is handled.

The id lives in a :class:`contextvars.ContextVar`, so tasks spawned for a request (a lease
release) carry it too; :class:`RequestIdFilter` copies it into each ``LogRecord`` as
``request_id`` (``-`` outside a request) for a format such as ``%(request_id)s``. Shared by the
orchestrator and the ctx/gen servers (stdlib only).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import re

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
    return _new_id()


class _NewIds:
    """``req-`` + 32 hex digits: 64 random bits drawn once per process, then a counter (a uuid4
    per request cost ~4 µs: a ``getrandom`` call and a UUID object). Drawn again in a forked
    child (another pid), so no two processes share the random half."""

    def __init__(self) -> None:
        self._pid, self._prefix, self._count = -1, "", itertools.count()

    def __call__(self) -> str:
        if self._pid != os.getpid():
            self._pid, self._prefix, self._count = os.getpid(), os.urandom(8).hex(), itertools.count()
        return f"req-{self._prefix}{next(self._count):016x}"


_new_id = _NewIds()


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the current request's id, or ``-``). Attach to handlers.

    ``prefix=True`` also starts the message of a record written inside a request with
    ``[<id>] `` (for handlers whose format does not name ``%(request_id)s``).
    """

    def __init__(self, prefix: bool = False) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        rid = current.get()
        record.request_id = rid or "-"
        if self.prefix and rid and not getattr(record, "_rid_prefixed", False):
            record.msg, record._rid_prefixed = f"[{rid}] {record.msg}", True
        return True


def install_log_filter(fmt: str | None = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s") -> None:
    """Put the filter on every root handler: with ``fmt``, as that handler's format; with ``None``,
    keeping each handler's format and prefixing messages written inside a request instead."""
    for handler in logging.getLogger().handlers:
        if any(isinstance(f, RequestIdFilter) for f in handler.filters):
            continue
        handler.addFilter(RequestIdFilter(prefix=fmt is None))
        if fmt is not None:
            handler.setFormatter(logging.Formatter(fmt))


def from_scope_headers(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's ``X-Request-Id`` if it is safe to log and echo, else None (servers make none)."""
    for name, value in headers:
        if name == HEADER:
            return value.decode("ascii") if 0 < len(value) <= MAX_LEN and _SAFE.match(value) else None
    return None
