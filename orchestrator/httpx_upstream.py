"""The hot path's upstream interface over an ``httpx`` transport, for apps built with
``create_app(topology, transport=...)`` (tests that reach the servers in-process, without sockets).

Same surface as :class:`~orchestrator.h1client.H1Client` (``post`` → a response with ``status``,
``next_chunk``, ``read``, ``ended``, ``abort``, ``close``; ``start`` → a pending post); failures become
:class:`~orchestrator.h1client.UpstreamError`. ``close`` must not await (it runs in cancelled
tasks), so the httpx response is closed in a task this client owns and awaits in :meth:`aclose`.
"""

from __future__ import annotations

import asyncio

import httpx

from .h1client import ConnectError, UpstreamError, UpstreamTimeout


class HttpxResponse:
    """One streamed httpx response behind the :class:`~orchestrator.h1client.Response` surface."""

    def __init__(self, resp: httpx.Response, owner: "HttpxUpstream") -> None:
        self._resp = resp
        self._owner = owner
        self.status = resp.status_code
        self.headers = dict(resp.headers)
        self._chunks = resp.aiter_bytes()
        self._error: UpstreamError | None = None
        self._ended = False
        self._closed = False

    @property
    def ended(self) -> bool:
        return self._ended

    async def next_chunk(self) -> bytes | None:
        """The next body piece, None at the end. Raises UpstreamError."""
        if self._error is not None:
            raise self._error
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            self._ended = True
            return None
        except httpx.HTTPError as err:
            raise self._error or UpstreamError(f"{type(err).__name__}: {err}") from None

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        self.close()
        return b"".join(parts)

    def abort(self, err: UpstreamError) -> None:
        self._error = err
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner.close_later(self._resp)


class HttpxUpstream:
    """``post`` through an ``httpx.AsyncClient`` (its transport decides where requests go)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._closing: set[asyncio.Task] = set()
        self.reconnects = 0

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: tuple[tuple[str, str], ...] = ()) -> HttpxResponse:
        request = self._client.build_request("POST", f"{base_url}{path}", content=body,
                                             headers={"content-type": "application/json", **dict(headers)})
        try:
            return HttpxResponse(await self._client.send(request, stream=True), self)
        except httpx.ConnectError as err:
            raise ConnectError(f"connect to {base_url} failed: {err}") from None
        except httpx.HTTPError as err:
            raise UpstreamError(f"{type(err).__name__}: {err}") from None

    async def start(self, base_url: str, path: str, body: bytes,
                    headers: tuple[tuple[str, str], ...] = ()) -> "PendingHttpx":
        """:meth:`post` started now in a task (an in-process transport has no socket to write on)."""
        return PendingHttpx(asyncio.get_running_loop().create_task(self.post(base_url, path, body, headers),
                                                                   name="upstream-post"))

    def close_later(self, resp: httpx.Response) -> None:
        task = asyncio.get_running_loop().create_task(resp.aclose(), name="close-upstream")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Wait (at most 5 s) for the responses still being closed."""
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=5.0)


class PendingHttpx:
    """:class:`~orchestrator.h1client.PendingPost`'s surface over a task running :meth:`HttpxUpstream.post`."""

    def __init__(self, task: asyncio.Task) -> None:
        self._task = task
        self._handed_out = False
        self._expired: UpstreamTimeout | None = None
        self.loop = task.get_loop()

    def expire(self) -> None:
        """The caller's deadline passed (as :meth:`PendingPost.expire`): the post is cancelled, or
        the response handed out is aborted; both then raise UpstreamTimeout."""
        err = self._expired = UpstreamTimeout("the caller's deadline passed")
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled() and self._task.exception() is None:
            self._task.result().abort(err)

    @property
    def expired(self) -> bool:
        """Whether :meth:`expire` ran."""
        return self._expired is not None

    async def response(self) -> HttpxResponse:
        """The response once its headers arrived. Raises UpstreamError (UpstreamTimeout after :meth:`expire`)."""
        try:
            resp = await self._task
        except asyncio.CancelledError:
            if self._expired is None or asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise  # our caller is cancelled, not the post
            raise self._expired from None
        if self._expired is not None:
            resp.close()
            raise self._expired
        self._handed_out = True
        return resp

    def failed(self) -> bool:
        """Whether a status other than 2xx already came (transport errors are not counted)."""
        task = self._task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return False
        return not 200 <= task.result().status < 300

    def close(self) -> None:
        """Idempotent; a no-op once :meth:`response` returned."""
        if self._handed_out:
            return
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled() and self._task.exception() is None:
            self._task.result().close()
