"""orchestrator.http_protocol: a response head leaves in one write with the first body bytes, or on
its own at the loop's next turn; everything else is written as uvicorn wrote it."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from orchestrator.http_protocol import HeadWithBodyProtocol, _HeadHoldingTransport
from orchestrator.serve_options import SERVE_OPTIONS
from orch_fakes import ThreadServer

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class RecordingTransport:
    """What the real transport was asked to write, one entry per write call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name in ("peername", "sockname") else default


def test_head_and_first_body_leave_in_one_write() -> None:
    async def run() -> list[bytes]:
        real = RecordingTransport()
        t = _HeadHoldingTransport(real)  # type: ignore[arg-type]
        t.write(HEAD)
        assert real.writes == []  # held until the body comes
        assert t.get_write_buffer_size() == len(HEAD)
        t.write(b"5\r\nhello\r\n")
        t.write(b"0\r\n\r\n")
        await asyncio.sleep(0)  # the scheduled flush finds nothing left to send
        return real.writes

    assert asyncio.run(run()) == [HEAD + b"5\r\nhello\r\n", b"0\r\n\r\n"]


def test_a_head_alone_leaves_at_the_next_loop_turn() -> None:
    async def run() -> tuple[list[bytes], list[bytes]]:
        real = RecordingTransport()
        t = _HeadHoldingTransport(real)  # type: ignore[arg-type]
        t.write(HEAD)
        before = list(real.writes)
        await asyncio.sleep(0)
        return before, real.writes

    before, after = asyncio.run(run())
    assert before == [] and after == [HEAD]


def test_interim_answers_and_close_are_not_delayed() -> None:
    async def run() -> RecordingTransport:
        real = RecordingTransport()
        t = _HeadHoldingTransport(real)  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client waits for it before sending its body
        assert real.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        t.close()  # a head-only answer still leaves before the connection closes
        await asyncio.sleep(0)
        return real

    real = asyncio.run(run())
    assert real.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n"] and real.closed


def test_the_orchestrator_serves_with_it() -> None:
    assert SERVE_OPTIONS["http"] is HeadWithBodyProtocol


async def _slow_stream(scope, receive, send) -> None:
    """A head, then (after an await) two body parts: the head must not wait for the first."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await asyncio.sleep(0.5)
    await send({"type": "http.response.body", "body": b"late", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _recv_until(sock: socket.socket, end: bytes, timeout_s: float) -> bytes:
    buf, deadline = b"", time.monotonic() + timeout_s
    while not buf.endswith(end) and time.monotonic() < deadline:
        piece = sock.recv(65536)
        if not piece:
            break
        buf += piece
    return buf


@pytest.mark.timeout(30)
def test_over_uvicorn_a_head_with_no_body_yet_reaches_the_client() -> None:
    srv = ThreadServer(_slow_stream, http=HeadWithBodyProtocol).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head = _recv_until(sock, b"\r\n\r\n", 0.4)  # before the app's 0.5 s sleep ends
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
            rest = _recv_until(sock, b"0\r\n\r\n", 5)
            assert rest == b"4\r\nlate\r\n0\r\n\r\n"
    finally:
        srv.stop()


@pytest.mark.timeout(30)
def test_over_uvicorn_a_client_that_leaves_fires_its_requests_disconnect_hook() -> None:
    """HeadWithBodyProtocol puts one DisconnectHook per connection in each request's scope and
    calls it from connection_lost: the app learns that its client left with no task of its own."""
    from orchestrator.http_protocol import DISCONNECT_HOOK

    fired, set_up = [], []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        hook = scope[DISCONNECT_HOOK]
        done = asyncio.Event()
        hook.callback = lambda: (fired.append(True), done.set())
        set_up.append(True)
        await asyncio.wait_for(done.wait(), 10)

    srv = ThreadServer(app, http=HeadWithBodyProtocol).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + 5
            while not set_up and time.monotonic() < deadline:
                time.sleep(0.01)
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired == [True]
    finally:
        srv.stop()


def test_disconnect_watch_cancels_through_the_hook_or_through_a_watcher_task() -> None:
    """orchestrator.front's watch: with a hook (our protocol) the hook cancels the request's task;
    without one (another ASGI server) a task waiting for http.disconnect does; after stop(), a
    disconnect cancels nothing (the answer's last byte had left)."""
    from orchestrator.front import _DisconnectWatch
    from orchestrator.http_protocol import DISCONNECT_HOOK, DisconnectHook

    async def main() -> None:
        disconnect = asyncio.Event()

        async def receive():
            await disconnect.wait()
            return {"type": "http.disconnect"}

        for scope in ({DISCONNECT_HOOK: DisconnectHook()}, {}):
            disconnect.clear()

            async def request(scope=scope):
                watch = _DisconnectWatch(scope, receive)
                try:
                    await asyncio.sleep(10)
                finally:
                    watch.stop()
                    assert watch.disconnected

            task = asyncio.get_running_loop().create_task(request())
            await asyncio.sleep(0.01)
            if scope:
                scope[DISCONNECT_HOOK].fire()
            else:
                disconnect.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)

        hook = DisconnectHook()

        async def finished():
            watch = _DisconnectWatch({DISCONNECT_HOOK: hook}, receive)
            watch.stop()
            return watch

        watch = await finished()
        hook.fire()
        assert not watch.disconnected and hook.callback is None

    asyncio.run(asyncio.wait_for(main(), 10))
