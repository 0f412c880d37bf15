"""uvicorn's httptools protocol with each response head sent together with the first body bytes.

uvicorn writes ``http.response.start`` (status line and headers) to the socket at once, then
each body message in a write of its own: two ``send`` calls, two TCP segments, and two wake-ups
of a client that reads as data comes (an SSE client parses the head, then waits again for the
first event). :class:`HeadWithBodyProtocol` holds the head back until the next write on the
connection, the first body bytes, and sends both in one ``write``. A head that no write follows
in the same turn of the event loop (an app that awaits between ``http.response.start`` and its
first body message) leaves on its own at the loop's next turn (``loop.call_soon``), so nothing
waits longer than that. Nothing else changes: the bytes on the wire are the same, in the same
order; ``100 Continue`` interim answers are written at once.

It also hands each request a :class:`DisconnectHook`: the orchestrator's OpenAI routes learn that
their client left from ``connection_lost`` directly, instead of keeping a task per request
waiting in ``receive()`` for ``http.disconnect`` (a task created, stepped and cancelled per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1.1 "
_INTERIM = b"HTTP/1.1 1"  # 1xx (100 Continue): the client waits for it before sending the body


class _HeadHoldingTransport:
    """A proxy of one connection's transport whose :meth:`write` keeps a response head until the
    next write (or close) joins it, or the loop's next turn flushes it; every other attribute is
    the transport's own."""

    __slots__ = ("_transport", "_held", "_loop")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(_HEAD) and not data.startswith(_INTERIM):
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def writelines(self, lines: list[bytes]) -> None:
        self.write(b"".join(lines))

    def close(self) -> None:
        self._flush()  # a head-only answer (e.g. 204) still leaves before the connection closes
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)


DISCONNECT_HOOK = "pdserve.disconnect_hook"  # the scope key of a request's DisconnectHook


class DisconnectHook:
    """One connection's way to tell the request it is serving that the client left, without a task
    per request blocked in ``receive()`` for ``http.disconnect``: the app sets :attr:`callback`
    (and clears it once its answer's last byte is handed over); the protocol calls it from
    ``connection_lost``. The request's scope holds it under :data:`DISCONNECT_HOOK`."""

    __slots__ = ("callback",)

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None

    def fire(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class HeadWithBodyProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` writing through :class:`_HeadHoldingTransport` (see the module
    docstring), and putting the connection's :class:`DisconnectHook` in every request's scope;
    pass it as uvicorn's ``http`` option."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.disconnect_hook = DisconnectHook()
        super().connection_made(_HeadHoldingTransport(transport))  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT_HOOK] = self.disconnect_hook  # type: ignore[literal-required]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # uvicorn pauses reading past 64 KiB of buffered body and only receive() resumes it; with
        # the hook nobody calls receive() after the body, so a big body would leave reading off
        # and a client's close unseen (no connection_lost). The body is whole now: read on (a
        # pipelined next request still pauses it in on_headers_complete).
        if self.flow is not None:
            self.flow.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.disconnect_hook.fire()
