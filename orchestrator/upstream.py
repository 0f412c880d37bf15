"""One HTTP attempt against one ctx/gen server, with failures sorted into retry / relay.

* 2xx → the answer.
* 4xx → :class:`~orchestrator.errors.UpstreamRejected` (status and body go to the client, no retry).
* 5xx, connect error, broken connection, timeout, unparsable answer → :class:`AttemptFailed`
  (the caller marks the server unhealthy and retries on another one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx

from .errors import UpstreamRejected, error_type
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


def describe(err: BaseException) -> str:
    """``ConnectError: [Errno 111] ...`` (the class name stays when the message is empty)."""
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _json_or_error(resp: httpx.Response) -> dict:
    """The body as a JSON object; a non-JSON body becomes an OpenAI error body holding its text."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    text = resp.text[:500] or resp.reason_phrase
    return {"error": {"message": text, "type": error_type(resp.status_code), "param": None,
                      "code": resp.status_code}}


def check_status(resp: httpx.Response, phase: str) -> None:
    """Raise UpstreamRejected (4xx) or AttemptFailed (anything else but 2xx). Body must be read."""
    if 200 <= resp.status_code < 300:
        return
    body = _json_or_error(resp)
    if 400 <= resp.status_code < 500:
        raise UpstreamRejected(resp.status_code, body, phase)
    info = body.get("error") if isinstance(body.get("error"), dict) else {}
    raise AttemptFailed(f"HTTP {resp.status_code}: {info.get('message', body)}", server_fault=False,
                        error_type=info.get("type"))


async def post_json(client: httpx.AsyncClient, server: Server, path: str, body: dict,
                    timeout_s: float, phase: str) -> dict:
    """POST ``body`` and return the JSON answer; the whole exchange is bounded by ``timeout_s``.

    Raises:
        UpstreamRejected: the server answered 4xx.
        AttemptFailed: 5xx, transport error, timeout, or a 2xx answer that is not a JSON object.
    """
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(f"{server.url}{path}", json=body)
    except TimeoutError:
        raise AttemptFailed(f"no answer within {timeout_s:g} s") from None
    except httpx.HTTPError as err:
        raise AttemptFailed(describe(err)) from None
    check_status(resp, phase)
    try:
        answer = resp.json()
    except ValueError:
        raise AttemptFailed("answer is not JSON") from None
    if not isinstance(answer, dict):
        raise AttemptFailed("answer is not a JSON object")
    return answer


@dataclass
class OpenStream:
    """An upstream streaming response whose first chunk has already arrived."""

    response: httpx.Response
    first_chunk: bytes
    chunks: AsyncIterator[bytes]

    async def aclose(self) -> None:
        await self.response.aclose()


async def open_stream(client: httpx.AsyncClient, server: Server, path: str, body: dict,
                      timeout_s: float, phase: str) -> OpenStream:
    """POST a streaming request and wait (at most ``timeout_s`` s) for its first body chunk.

    Nothing has reached the client yet when this raises, so the caller may retry elsewhere.

    Raises:
        UpstreamRejected: the server answered 4xx.
        AttemptFailed: 5xx, transport error, timeout, or a stream that ended before any byte.
    """
    resp: httpx.Response | None = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.send(client.build_request("POST", f"{server.url}{path}", json=body), stream=True)
            if not 200 <= resp.status_code < 300:
                await resp.aread()
                check_status(resp, phase)
            chunks = resp.aiter_bytes()
            first = b""
            while not first:  # skip empty chunks
                first = await anext(chunks)
            return OpenStream(resp, first, chunks)
    except (UpstreamRejected, AttemptFailed):
        await _close_quietly(resp)
        raise
    except asyncio.CancelledError:  # the client left: closing the response aborts the gen request
        with anyio.CancelScope(shield=True):
            await _close_quietly(resp)
        raise
    except StopAsyncIteration:
        await _close_quietly(resp)
        raise AttemptFailed("stream ended before its first byte") from None
    except TimeoutError:
        await _close_quietly(resp)
        raise AttemptFailed(f"no first byte within {timeout_s:g} s") from None
    except httpx.HTTPError as err:
        await _close_quietly(resp)
        raise AttemptFailed(describe(err)) from None


async def _close_quietly(resp: httpx.Response | None) -> None:
    if resp is None:
        return
    try:
        await resp.aclose()
    except httpx.HTTPError as err:
        log.debug("closing upstream response: %s", describe(err))


async def release_lease(client: httpx.AsyncClient, ctx_url: str, ctx_request_id: str, timeout_s: float) -> bool:
    """POST ``/disagg/release`` to the ctx server holding the lease. Best effort: never raises.

    Returns whether the server said it freed the lease (False on any failure; failures are logged).
    """
    try:
        resp = await client.post(f"{ctx_url}/disagg/release", json={"ctx_request_id": ctx_request_id},
                                 timeout=timeout_s)
    except httpx.HTTPError as err:
        log.warning("release of lease %s on %s failed: %s", ctx_request_id, ctx_url, describe(err))
        return False
    if resp.status_code != 200:
        log.warning("release of lease %s on %s answered HTTP %d", ctx_request_id, ctx_url, resp.status_code)
        return False
    try:
        return bool(resp.json().get("released", False))
    except (ValueError, AttributeError):
        return False
