"""A lean HTTP/1.1 client for the orchestrator's hot path (ctx and gen requests).

Why not httpx here: under the overhead bench, httpx/httpcore took 62% of the orchestrator's CPU,
most of it in the connection pool's per-request scan of every pooled connection
(``has_expired`` → a readability probe per connection). This client keeps, per server origin, a
LIFO stack of idle keep-alive connections; a connection the server closes leaves the stack at
once (the event loop sees the EOF), so a checkout costs O(1).

Protocol (RFC 9112): one request at a time per connection, ``Content-Length`` request bodies,
responses framed by ``Content-Length``, chunked transfer coding or connection close (the
``httptools`` parser decodes all three). A connection goes back to its pool only after its
response ended and both sides allow keep-alive; a response abandoned early closes its
connection, which is how the server learns the request was cancelled.

:meth:`H1Client.start` writes a request and returns at once (:class:`PendingPost`): the answer
is read later, so two requests can be in flight from one task (generation_first).

Every failure is an :class:`UpstreamError`; timeouts are the caller's (a timer calling
:meth:`PendingPost.expire` or :meth:`Response.abort`, or an ``asyncio.timeout`` around the
calls), except the connect timeout, which is this client's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator

import httptools

log = logging.getLogger("orchestrator.h1client")

IDLE_TIMEOUT_S = 4.0        # below uvicorn's default keep-alive of 5 s: never reuse what the server may be closing
MAX_IDLE_PER_ORIGIN = 256
READ_HIGH_WATER = 1 << 20   # bytes buffered before reading from the socket pauses


class UpstreamError(Exception):
    """A transport failure: connect refused or timed out, connection broken, malformed answer."""


class UpstreamTimeout(UpstreamError):
    """The caller's deadline for the response passed (see :meth:`Response.abort`)."""


class ConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, or the connect timeout passed)."""


class Response:
    """One response. ``status`` and ``headers`` (lower-cased names) are set once it is returned.

    Read the body with :meth:`read` or :meth:`iter_chunks`; :meth:`close` when done (idempotent;
    closes the connection unless the response was read to its end).
    """

    def __init__(self, conn: "_Connection") -> None:
        self._conn = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as they came (the hot path reads none)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._closed = False

    # -- fed by the connection ---------------------------------------------------------------
    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, err: BaseException) -> None:
        if not self._complete and self._error is None:
            self._error = err
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- read by the caller ------------------------------------------------------------------
    @property
    def headers(self) -> dict[str, str]:
        """The headers, names lower-cased (decoded on each call: nothing on the hot path asks)."""
        return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in self.raw_headers}

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def ended(self) -> bool:
        """Complete, and every body piece handed out."""
        return self._complete and not self._chunks

    def abort(self, err: UpstreamError) -> None:
        """Fail the response with ``err`` (unless it is complete) and close its connection."""
        self._fail(err)
        self.close()

    async def next_chunk(self) -> bytes | None:
        """Every body byte that arrived since the last call (de-chunked, one piece), waiting for
        at least one; None at the body's end. Raises UpstreamError.

        One socket read often holds several HTTP chunks (a gen server's SSE events written back to
        back): they come back as one piece, so the relay writes them to its client at once."""
        while not self._chunks:
            if self._complete:
                return None
            if self._error is not None:
                err = self._error
                raise (err if isinstance(err, UpstreamError) else UpstreamError(str(err))) from None
            self._waiter = self._conn.loop.create_future()
            await self._waiter
            self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        paused, self._buffered = self._buffered > READ_HIGH_WATER, 0
        if paused:
            self._conn.resume()
        return data

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        """The whole body; then the connection goes back to the pool. Raises UpstreamError."""
        parts = [c async for c in self.iter_chunks()]
        self.close()
        return b"".join(parts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn.release(reusable=self._complete and not self._chunks)


class _Connection(asyncio.Protocol):
    """One TCP connection; parser callbacks feed the current :class:`Response`."""

    def __init__(self, pool: "_OriginPool") -> None:
        self._pool = pool
        # Looked up once per connection: asyncio.get_running_loop() checks the pid (a getpid
        # system call) on every call, and a request made ~12 such calls.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None
        self._header_name = b""
        self._headers_done: asyncio.Future | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._keep_alive = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._response is None:  # bytes nobody asked for: the connection cannot be trusted
            self._abort(UpstreamError("unexpected bytes on an idle connection"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._abort(UpstreamError(f"malformed HTTP answer: {err}"))

    def eof_received(self) -> bool:
        try:
            self._parser.feed_data(b"")  # ends a body framed by connection close
        except httptools.HttpParserError:
            pass
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        err = UpstreamError(f"connection closed by the server{f': {exc}' if exc else ''}")
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_exception(err)
        if self._response is not None:
            self._response._fail(err)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        self._response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self._response is not None
        self._response.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._response._push(body)

    def on_message_complete(self) -> None:
        assert self._response is not None
        self._response._finish()

    # used by the client
    def start(self, head: bytes, body: bytes) -> tuple[Response, asyncio.Future]:
        """Write one request now; the future completes when its status line and headers arrived."""
        response = self._response = Response(self)
        headers_done = self._headers_done = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(head + body)
        return response, headers_done

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def release(self, reusable: bool) -> None:
        """The response is done with; keep the connection for the next request if allowed."""
        self._response, self._headers_done = None, None
        if reusable and self._keep_alive and not self.closed:
            self.idle_since = time.monotonic()
            self._pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pool.forget(self)
            if self.transport is not None:
                self.transport.close()

    def _abort(self, err: UpstreamError) -> None:
        if self._response is not None:
            self._response._fail(err)
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_exception(err)
        self.close()


class _OriginPool:
    """Idle keep-alive connections to one ``host:port``, most recently used first."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[_Connection] = []

    def take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_TIMEOUT_S:
                conn.reused = True
                return conn
            conn.close()
        return None

    def put(self, conn: _Connection) -> None:
        if len(self._idle) >= MAX_IDLE_PER_ORIGIN:
            conn.close()
            return
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        # O(n) but only when a server closes an idle connection or a pool is full, never per request.
        if conn in self._idle:
            self._idle.remove(conn)

    def close_all(self) -> None:
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()


class H1Client:
    """Pooled HTTP/1.1 requests to servers named by ``http://host:port`` base URLs.

    ``connect_timeout_s``: TCP connect bound (s). ``user_agent`` is sent with every request.
    """

    def __init__(self, connect_timeout_s: float, user_agent: str = "pdserve-orchestrator") -> None:
        self._connect_timeout_s = connect_timeout_s
        self._pools: dict[str, _OriginPool] = {}
        self._user_agent = user_agent.encode()
        self.reconnects = 0  # requests re-sent once because a pooled connection was closed under them

    def _pool(self, base_url: str) -> _OriginPool:
        pool = self._pools.get(base_url)
        if pool is None:
            if not base_url.startswith("http://"):
                raise UpstreamError(f"only http:// servers are supported, got {base_url!r}")
            hostport = base_url[len("http://"):].rstrip("/")
            host, _, port = hostport.rpartition(":")
            if not host or not port.isdigit():
                raise UpstreamError(f"server URL needs host:port, got {base_url!r}")
            pool = self._pools[base_url] = _OriginPool(host.strip("[]"), int(port))
        return pool

    async def _connect(self, pool: _OriginPool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(pool), pool.host, pool.port)
        except TimeoutError:
            raise ConnectError(f"connect to {pool.host}:{pool.port} timed out after {self._connect_timeout_s:g} s") from None
        except OSError as err:
            raise ConnectError(f"connect to {pool.host}:{pool.port} failed: {err}") from None
        return conn

    def _head(self, pool: _OriginPool, path: str, body: bytes, headers: tuple[tuple[str, str], ...]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        return (f"POST {path} HTTP/1.1\r\nHost: {pool.host}:{pool.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}").encode("latin-1") + b"User-Agent: " + self._user_agent + b"\r\n\r\n"

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: tuple[tuple[str, str], ...] = ()) -> Response:
        """POST ``body`` (JSON bytes) to ``base_url + path``; returns once the status line and headers
        arrived. The caller reads or closes the :class:`Response`. Raises UpstreamError."""
        return await (await self.start(base_url, path, body, headers)).response()

    async def start(self, base_url: str, path: str, body: bytes,
                    headers: tuple[tuple[str, str], ...] = ()) -> "PendingPost":
        """Write a POST on a pooled (or, awaited, a new) connection and return at once: the request
        is on its way while the caller does other work (the generation_first dispatch writes its
        gen request while its ctx request is out, with no task of its own for either). Raises UpstreamError
        (connect)."""
        pool = self._pool(base_url)
        head = self._head(pool, path, body, headers)
        conn = pool.take()
        if conn is None:
            conn = await self._connect(pool)
        return PendingPost(self, pool, conn, head, body)

    def _reconnected(self, base_url: str, err: UpstreamError) -> None:
        # The server closed a pooled connection as we wrote on it (RFC 9112 §9.3.1: no byte of an
        # answer came, so the request was never processed). One fresh try.
        self.reconnects += 1
        log.info("pooled connection to %s failed before any answer (%s); resending on a new one", base_url, err)

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close_all()
        self._pools.clear()


class PendingPost:
    """A POST already written on its connection (:meth:`H1Client.start`). :meth:`response` waits for
    its status line and headers (resending once on a new connection when a pooled one closed
    before any byte of an answer); :meth:`close` abandons it (the connection is closed, which tells
    the server to stop), unless :meth:`response` handed the response out (then the caller closes that)."""

    def __init__(self, client: H1Client, pool: _OriginPool, conn: _Connection, head: bytes, body: bytes) -> None:
        self._client, self._pool, self._conn, self._head, self._body = client, pool, conn, head, body
        self._response, self._headers_done = conn.start(head, body)
        self._handed_out = False
        self._expired: UpstreamTimeout | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the request runs on (its connection's)."""
        return self._conn.loop

    @property
    def expired(self) -> bool:
        """Whether :meth:`expire` ran (a response read after it may still hold bytes that came first)."""
        return self._expired is not None

    def expire(self) -> None:
        """The caller's deadline passed: a pending or later :meth:`response`, and a read of the
        response, raise :class:`UpstreamTimeout`, and the connection closes (which tells the server
        to stop); body bytes already buffered can still be read (:attr:`expired` tells). A timer
        calls this (``loop.call_at``): one scheduled callback instead of an ``asyncio.timeout``
        scope per upstream request."""
        err = self._expired = UpstreamTimeout("the caller's deadline passed")
        if not self._headers_done.done():
            self._headers_done.set_exception(err)
        self._response.abort(err)

    async def response(self) -> Response:
        """The response once its headers arrived. Raises UpstreamError (UpstreamTimeout after
        :meth:`expire`)."""
        try:
            await self._headers_done
        except UpstreamError as err:
            self._conn.close()
            if not self._conn.reused or self._expired is not None:
                raise
            self._client._reconnected(f"http://{self._pool.host}:{self._pool.port}", err)
            self._conn = await self._client._connect(self._pool)
            if self._expired is not None:  # the deadline passed while connecting again
                self._conn.close()
                raise self._expired from None
            self._response, self._headers_done = self._conn.start(self._head, self._body)
            try:
                await self._headers_done
            except BaseException:
                self._conn.close()
                raise
        except BaseException:
            self._conn.close()  # on cancellation too: closing is what tells the server to stop
            raise
        self._handed_out = True
        return self._response

    def failed(self) -> bool:
        """Whether a status line other than 2xx already came, without anyone waiting for it (a
        broken connection is not counted: :meth:`response` may still resend)."""
        fut = self._headers_done
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return False
        return not 200 <= self._response.status < 300

    def close(self) -> None:
        """Idempotent; a no-op once :meth:`response` returned (close the response instead)."""
        if self._handed_out:
            return
        if self._headers_done.done() and not self._headers_done.cancelled():
            self._headers_done.exception()  # retrieved: no "exception was never retrieved" warning
        else:
            self._headers_done.cancel()
        self._conn.close()
