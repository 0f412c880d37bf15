"""One HTTP attempt against one ctx/gen server, with failures sorted into retry / relay.

* 2xx → the answer.
* 4xx → :class:`~orchestrator.errors.UpstreamRejected` (status and body go to the client, no retry).
* 5xx, connect error, broken connection, timeout, unparsable answer → :class:`AttemptFailed`
  (the caller marks the server unhealthy and retries on another one).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from . import jsonio
from .errors import UpstreamRejected, error_type
from .h1client import H1Client, PendingPost, Response, UpstreamError, UpstreamTimeout
from .pools import Server

log = logging.getLogger("orchestrator.upstream")


class AttemptFailed(Exception):
    """One attempt on one server failed in a way another server may not (retryable).

    ``server_fault``: the server itself looks broken (no answer, broken connection), as opposed to
    a 5xx answer about this one request (the health poll judges the server then).
    ``error_type``: the OpenAI error ``type`` of a 5xx answer (e.g. ``kv_transfer_error``).
    """

    def __init__(self, message: str, *, server_fault: bool = True, error_type: str | None = None) -> None:
        super().__init__(message)
        self.server_fault = server_fault
        self.error_type = error_type


def check_gen_answer(raw: bytes) -> dict:
    """A gen server's 2xx JSON answer, parsed: it must be a JSON object. Raises AttemptFailed otherwise."""
    try:
        answer = jsonio.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise AttemptFailed("gen answer is not a JSON object")
    return answer


def describe(err: BaseException) -> str:
    """``ConnectError: [Errno 111] ...`` (the class name stays when the message is empty)."""
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _json_or_error(status: int, raw: bytes) -> dict:
    """The body as a JSON object; a non-JSON body becomes an OpenAI error body holding its text."""
    try:
        body = jsonio.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    text = raw[:500].decode("utf-8", "replace") or f"HTTP {status}"
    return {"error": {"message": text, "type": error_type(status), "param": None, "code": status}}


def check_status(status: int, raw: bytes, phase: str) -> None:
    """Raise UpstreamRejected (4xx) or AttemptFailed (anything else but 2xx) for an answer ``raw``."""
    if 200 <= status < 300:
        return
    body = _json_or_error(status, raw)
    if 400 <= status < 500:
        raise UpstreamRejected(status, body, phase)
    info = body.get("error") if isinstance(body.get("error"), dict) else {}
    raise AttemptFailed(f"HTTP {status}: {info.get('message', body)}", server_fault=False,
                        error_type=info.get("type"))


def request_headers(request_id: str | None, auth: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """Headers every upstream request carries: the client's request id, when there is one, and
    ``auth`` (the pool's ``Authorization`` header when its servers require an API key)."""
    return ((("X-Request-Id", request_id),) if request_id else ()) + auth


async def start_post(client: H1Client, server: Server, path: str, body: bytes, request_id: str | None = None,
                     auth: tuple[tuple[str, str], ...] = ()) -> PendingPost:
    """Write a JSON POST to ``server`` now (a pooled connection, or a new one: bounded by the
    client's connect timeout) and return at once; :func:`read_answer` / :func:`first_chunk` wait
    for the answer. Raises AttemptFailed (no connection)."""
    try:
        return await client.start(server.url, path, body, request_headers(request_id, auth))
    except UpstreamError as err:
        raise AttemptFailed(describe(err)) from None


async def read_answer(pending: PendingPost, deadline: float, phase: str, timeout_s: float) -> bytes:
    """The raw 2xx answer of ``pending``, read in full by ``deadline`` (``loop.time()``: a timer
    expires ``pending`` then; ``timeout_s`` names the bound in the error).

    Raises:
        UpstreamRejected: the server answered 4xx.
        AttemptFailed: 5xx, transport error or timeout.
    """
    resp: Response | None = None
    timer = pending.loop.call_at(deadline, pending.expire)
    try:
        resp = await pending.response()
        raw = await resp.read()
    except UpstreamTimeout:
        raise AttemptFailed(f"no answer within {timeout_s:g} s") from None
    except UpstreamError as err:
        raise AttemptFailed(describe(err)) from None
    finally:
        timer.cancel()
        pending.close()  # a no-op once the response was handed out
        if resp is not None:
            resp.close()  # a no-op once read; on cancellation it closes the connection (aborts upstream)
    check_status(resp.status, raw, phase)
    return raw


async def post_json_raw(client: H1Client, server: Server, path: str, body: bytes, timeout_s: float, phase: str,
                        request_id: str | None = None, auth: tuple[tuple[str, str], ...] = ()) -> bytes:
    """POST JSON ``body`` and return the raw 2xx answer; the whole exchange is bounded by ``timeout_s``.

    Raises:
        UpstreamRejected: the server answered 4xx.
        AttemptFailed: 5xx, transport error or timeout.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    pending = await start_post(client, server, path, body, request_id, auth)  # bounded by the connect timeout
    return await read_answer(pending, deadline, phase, timeout_s)


@dataclass
class OpenStream:
    """An upstream streaming response whose first chunk has already arrived."""

    response: Response
    first_chunk: bytes

    async def next_chunk(self) -> bytes | None:
        """The next body piece, None at the end. Raises UpstreamError when the stream breaks."""
        return await self.response.next_chunk()

    def ended(self) -> bool:
        """Whether the upstream response is complete and every chunk of it was read."""
        return self.response.ended

    def expire(self) -> None:
        """Cut the stream: a pending or later :meth:`next_chunk` raises UpstreamTimeout."""
        self.response.abort(UpstreamTimeout("timed out"))

    def close(self) -> None:
        """Idempotent; closing a stream that has not ended aborts the request on the server."""
        self.response.close()


async def open_stream(client: H1Client, server: Server, path: str, body: bytes, timeout_s: float, phase: str,
                      request_id: str | None = None, auth: tuple[tuple[str, str], ...] = ()) -> OpenStream:
    """POST a streaming request and wait (at most ``timeout_s`` s) for its first body chunk.

    Nothing has reached the client yet when this raises, so the caller may retry elsewhere.

    Raises:
        UpstreamRejected: the server answered 4xx.
        AttemptFailed: 5xx, transport error, timeout, or a stream that ended before any byte.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    pending = await start_post(client, server, path, body, request_id, auth)  # bounded by the connect timeout
    return await first_chunk(pending, deadline, phase, timeout_s)


async def first_chunk(pending: PendingPost, deadline: float, phase: str, timeout_s: float) -> OpenStream:
    """The stream of ``pending`` once its first body chunk arrived, by ``deadline`` (``loop.time()``;
    ``timeout_s`` names the bound in the error). Raises as :func:`open_stream`."""
    resp: Response | None = None
    timer = pending.loop.call_at(deadline, pending.expire)
    try:
        resp = await pending.response()
        if not 200 <= resp.status < 300:
            check_status(resp.status, await resp.read(), phase)
        first = b""
        while not first:  # skip empty chunks
            chunk = await resp.next_chunk()
            if chunk is None:
                raise AttemptFailed("stream ended before its first byte")
            first = chunk
        if pending.expired:  # the deadline passed in the turn the first chunk came: the stream is cut
            raise UpstreamTimeout("the caller's deadline passed")
        return OpenStream(resp, first)
    except BaseException as err:
        pending.close()
        if resp is not None:
            resp.close()  # on cancellation (the client left) this is what aborts the gen request
        if isinstance(err, UpstreamTimeout):
            raise AttemptFailed(f"no first byte within {timeout_s:g} s") from None
        if isinstance(err, UpstreamError):
            raise AttemptFailed(describe(err)) from None
        raise
    finally:
        timer.cancel()


async def release_lease(client: H1Client, ctx_url: str, ctx_request_id: str, timeout_s: float,
                        request_id: str | None = None) -> bool:
    """POST ``/disagg/release`` to the ctx server holding the lease. Best effort: never raises.

    Returns whether the server said it freed the lease (False on any failure; failures are logged).
    """
    resp: Response | None = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(ctx_url, "/disagg/release", jsonio.dumps({"ctx_request_id": ctx_request_id}),
                                     request_headers(request_id))
            raw = await resp.read()
    except (TimeoutError, UpstreamError) as err:
        log.warning("release of lease %s on %s failed: %s", ctx_request_id, ctx_url, describe(err))
        return False
    finally:
        if resp is not None:
            resp.close()
    if resp.status != 200:
        log.warning("release of lease %s on %s answered HTTP %d", ctx_request_id, ctx_url, resp.status)
        return False
    try:
        answer = jsonio.loads(raw)
    except ValueError:
        return False
    return isinstance(answer, dict) and bool(answer.get("released", False))
