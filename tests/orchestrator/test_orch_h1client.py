"""The hot path's HTTP/1.1 client against scripted raw TCP servers: keep-alive reuse, chunked
bodies, a pooled connection closed under a request (one resend), broken bodies, refused
connects, and cancellation closing the connection (what aborts a request upstream)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.h1client import ConnectError, H1Client, UpstreamError

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"
CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"7\r\ndata: 1\r\n9\r\n\n\ndata: 2\r\n0\r\n\r\n")


class Script:
    """A TCP server on 127.0.0.1 whose n-th accepted connection runs ``handlers[n]``."""

    def __init__(self, *handlers) -> None:
        self.handlers = list(handlers)
        self.connections = 0
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = self.handlers[min(self.connections, len(self.handlers) - 1)]
        self.connections += 1
        try:
            await handler(self, reader, writer)
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


def answer_each(*answers: bytes):
    async def handler(script: Script, reader, writer) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
        await reader.read()  # hold the connection open until the client closes it
    return handler


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_keep_alive_reuses_one_connection_and_sends_headers():
    seen: list[bytes] = []

    async def handler(script, reader, writer) -> None:
        for _ in range(3):
            seen.append(await read_request(reader))
            writer.write(OK)
        await reader.read()

    async def main() -> int:
        script = Script(handler)
        async with script as url:
            client = H1Client(1.0)
            for _ in range(3):
                resp = await client.post(url, "/v1/completions", b'{"a":1}', (("X-Request-Id", "rid-1"),))
                assert resp.status == 200 and await resp.read() == b'{"ok":true}'
                assert resp.headers == {"content-type": "application/json", "content-length": "11"}
            await client.aclose()
            return script.connections

    assert run(main()) == 1
    assert all(b"X-Request-Id: rid-1\r\n" in r and r.endswith(b'\r\n\r\n{"a":1}') for r in seen)


def test_chunked_stream_arrives_in_pieces_and_ends():
    async def main() -> list[bytes]:
        async with Script(answer_each(CHUNKED)) as url:
            client = H1Client(1.0)
            resp = await client.post(url, "/v1/completions", b"{}")
            chunks = [c async for c in resp.iter_chunks()]
            assert resp.ended
            resp.close()
            await client.aclose()
            return chunks

    assert b"".join(run(main())) == b"data: 1\n\ndata: 2"


def test_pooled_connection_closed_under_a_request_is_resent_once_on_a_new_one():
    async def answer_once_then_drop(script, reader, writer) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)  # the second request arrives, then the server "times out" the connection

    async def main() -> tuple[int, int]:
        script = Script(answer_once_then_drop, answer_each(OK))
        async with script as url:
            client = H1Client(1.0)
            assert await (await client.post(url, "/", b"{}")).read() == b'{"ok":true}'
            assert await (await client.post(url, "/", b"{}")).read() == b'{"ok":true}'
            await client.aclose()
            return script.connections, client.reconnects

    assert run(main()) == (2, 1)


def test_body_cut_short_raises_upstream_error():
    async def cut(script, reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\"")

    async def main() -> None:
        async with Script(cut) as url:
            client = H1Client(1.0)
            resp = await client.post(url, "/", b"{}")
            with pytest.raises(UpstreamError, match="closed"):
                await resp.read()
            await client.aclose()

    run(main())


def test_refused_connect_is_a_connect_error():
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectError, match="Errno 111"):
            await H1Client(1.0).post(f"http://127.0.0.1:{port}", "/", b"{}")

    run(main())


def test_cancelled_request_closes_its_connection():
    async def never_answer(script, reader, writer) -> None:
        await read_request(reader)
        if await reader.read() == b"":  # EOF: the client closed the connection
            script.closed_by_client.set()

    async def main() -> None:
        script = Script(never_answer)
        async with script as url:
            client = H1Client(1.0)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await client.post(url, "/", b"{}")
            await asyncio.wait_for(script.closed_by_client.wait(), 2.0)
            await client.aclose()

    run(main())


def test_start_writes_at_once_and_the_answer_waits_in_the_buffer():
    """start(): the request reaches the server before anyone waits for the answer (no task); the
    answer, several HTTP chunks that came in one read, is read later, in one piece."""
    arrived = asyncio.Event()

    async def answer(script, reader, writer) -> None:
        await read_request(reader)
        arrived.set()
        writer.write(CHUNKED)
        await reader.read()

    async def main() -> None:
        async with Script(answer) as url:
            client = H1Client(1.0)
            pending = await client.start(url, "/v1/completions", b"{}")
            await asyncio.wait_for(arrived.wait(), 2.0)  # written, though nothing awaits the answer
            await asyncio.sleep(0.05)                     # the whole answer is in the buffer now
            assert not pending.failed()
            resp = await pending.response()
            assert resp.status == 200 and await resp.next_chunk() == b"data: 1\n\ndata: 2"
            assert await resp.next_chunk() is None
            resp.close()
            await client.aclose()

    run(main())


def test_a_pending_post_says_when_it_failed_and_closing_it_closes_the_connection():
    async def fail_then_hold(script, reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}")
        if await reader.read() == b"":
            script.closed_by_client.set()

    async def main() -> None:
        script = Script(fail_then_hold)
        async with script as url:
            client = H1Client(1.0)
            pending = await client.start(url, "/", b"{}")
            for _ in range(100):
                if pending.failed():
                    break
                await asyncio.sleep(0.01)
            assert pending.failed()
            pending.close()
            pending.close()  # idempotent
            await asyncio.wait_for(script.closed_by_client.wait(), 2.0)
            await client.aclose()

    run(main())


def test_deadline_timer_fails_a_silent_answer_and_closes_its_connection():
    """read_answer / first_chunk bound the answer by a timer (PendingPost.expire), not an
    asyncio.timeout scope: past the deadline the attempt fails, naming the bound, and the
    connection closes (what tells the server to stop); a keep-alive connection is not resent."""
    from orchestrator.pools import Server
    from orchestrator.upstream import AttemptFailed, first_chunk, read_answer, start_post

    async def headers_then_silence(script, reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if await reader.read() == b"":
            script.closed_by_client.set()

    async def never_answer(script, reader, writer) -> None:
        await read_request(reader)
        if await reader.read() == b"":
            script.closed_by_client.set()

    async def ok_then_silence(script, reader, writer) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await never_answer(script, reader, writer)

    async def one(handler, read, message: str, warm: bool = False) -> None:
        script = Script(handler)
        async with script as url:
            client = H1Client(1.0)
            server = Server("ctx", 0, url, "static")
            if warm:  # the timed-out request then goes out on a pooled keep-alive connection
                assert await (await client.post(url, "/", b"{}")).read() == b'{"ok":true}'
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            pending = await start_post(client, server, "/v1/completions", b"{}")
            with pytest.raises(AttemptFailed, match=message):
                await read(pending, t0 + 0.2, "ctx", 0.2)
            assert 0.15 < loop.time() - t0 < 2.0
            await asyncio.wait_for(script.closed_by_client.wait(), 2.0)
            assert script.connections == 1  # the expired request was not sent again
            await client.aclose()

    async def main() -> None:
        await one(never_answer, read_answer, r"no answer within 0.2 s")
        await one(headers_then_silence, read_answer, r"no answer within 0.2 s")
        await one(never_answer, first_chunk, r"no first byte within 0.2 s")
        await one(headers_then_silence, first_chunk, r"no first byte within 0.2 s")
        await one(ok_then_silence, read_answer, r"no answer within 0.2 s", warm=True)

    run(main())


def test_a_stream_whose_deadline_passed_as_its_first_chunk_came_is_a_timeout():
    """The timer may run in the loop turn that also brings the first chunk: the chunk is buffered
    but the connection is cut, so first_chunk must fail (retry elsewhere), not hand out a stream."""
    from orchestrator.pools import Server
    from orchestrator.upstream import AttemptFailed, first_chunk, start_post

    async def stream_then_hold(script, reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
        await reader.read()

    async def main() -> None:
        async with Script(stream_then_hold) as url:
            client = H1Client(1.0)
            pending = await start_post(client, Server("gen", 0, url, "static"), "/v1/completions", b"{}")
            resp = await pending.response()
            while not resp._chunks:  # the first chunk is buffered
                await asyncio.sleep(0.01)
            pending.expire()  # as the timer would, before the reader resumes
            loop = asyncio.get_running_loop()
            with pytest.raises(AttemptFailed, match="no first byte within 5 s"):
                await first_chunk(pending, loop.time() + 5, "gen", 5.0)
            await client.aclose()

    run(main())
