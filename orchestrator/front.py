"""The OpenAI routes (``POST /v1/chat/completions``, ``POST /v1/completions``) as raw ASGI.

The rest of the orchestrator is a FastAPI app; these two routes carry all the traffic, so they
skip FastAPI's routing, middleware stack and Starlette's streaming response (which spawns a task
group per request). Per request, in order:

1. the request id (client ``X-Request-Id`` or a new one) is set for logs and echoed on the answer;
2. admission: past ``orchestrator.max_inflight_requests`` open requests, 429 + ``Retry-After``;
3. the body is read (at most :data:`pdserve.request_body.MAX_BODY_BYTES`, else 413 and the
   connection closed) and parsed once by the shared rules (:func:`orchestrator.validation.parse_client_body`);
4. :meth:`DisaggFlow.handle` runs in the request's own task; a client disconnect before the last
   byte cancels that task (told by the connection's ``connection_lost`` through its
   :class:`~orchestrator.http_protocol.DisconnectHook`, or, under another ASGI server, by a watcher
   task waiting for ``http.disconnect``), which closes its upstream connections (that is what
   aborts the request on the servers).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope, Send

from pdserve import request_id
from .disagg import Exchange
from .errors import OrchestratorError
from .http_protocol import DISCONNECT_HOOK, DisconnectHook
from pdserve.request_body import MAX_BODY_BYTES

from .validation import parse_client_body, tools_of

if TYPE_CHECKING:
    from .app import Orchestrator

log = logging.getLogger("orchestrator.front")

OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class _DisconnectWatch:
    """Cancels the current task when the client leaves before the answer's last byte: through the
    connection's :class:`~orchestrator.http_protocol.DisconnectHook` when the server is uvicorn
    with :class:`~orchestrator.http_protocol.HeadWithBodyProtocol` (no task), else with one task
    waiting in ``receive()`` for ``http.disconnect``."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.disconnected = False
        self.done = False  # set when the last byte is handed to the server: a disconnect after it is normal
        self._hook: DisconnectHook | None = scope.get(DISCONNECT_HOOK)
        self._watch: asyncio.Task | None = None
        if self._hook is not None:
            self._hook.callback = self._left
        else:
            self._watch = asyncio.get_running_loop().create_task(self._run(receive), name="disconnect-watch")

    async def _run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._left()

    def _left(self) -> None:
        if not self.done and self.task is not None:
            self.disconnected = True
            self.task.cancel()

    def stop(self) -> None:
        self.done = True
        if self._hook is not None and self._hook.callback == self._left:  # not a later request's
            self._hook.callback = None
        if self._watch is not None:
            self._watch.cancel()


def _too_large(message: str) -> OrchestratorError:
    err = OrchestratorError(413, message, kind="bad_request")
    err.close_connection = True  # the rest of the body is still on the wire
    return err


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int, timeout_s: float) -> bytes:
    """The request body (at most ``limit`` bytes, within ``timeout_s``); a ``Content-Length`` over
    ``limit`` is refused before a byte is read.

    Raises:
        OrchestratorError: 413 past ``limit`` (connection closed); 408 when the body does not
            arrive in time; 499 (``client_disconnected``) when the client leaves while sending it.
    """
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(f"request body of {int(value)} bytes is over the {limit}-byte limit")
    parts, size = [], 0
    async with asyncio.timeout(timeout_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise OrchestratorError(499, "client disconnected", kind="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(f"request body is over the {limit}-byte limit")
            parts.append(chunk)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)


def _session_key(orch: "Orchestrator", scope: Scope, body: dict) -> str | None:
    mode = orch.settings.session_affinity
    if mode == "user":
        user = body.get("user")
        return user if isinstance(user, str) and user else None
    if mode == "header":
        name = orch.settings.session_header.lower().encode("latin-1")
        for key, value in scope["headers"]:
            if key == name:
                return value.decode("latin-1") or None
    return None


async def serve_openai(orch: "Orchestrator", scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one OpenAI request (see the module docstring). Never raises but CancelledError at
    shutdown; every error leaves as an OpenAI-style body."""
    endpoint = scope["path"]
    rid = request_id.from_headers(scope["headers"])
    token = request_id.current.set(rid)
    rid_header = (b"x-request-id", rid.encode("ascii"))
    watch: _DisconnectWatch | None = None
    status = 0

    async def send_with_id(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            message["headers"] = [*message.get("headers", ()), rid_header]
        elif not message.get("more_body", False) and watch is not None:
            watch.done = True
        await send(message)

    admitted = False
    try:
        try:
            orch.admission.enter()
            admitted = True
            s = orch.settings
            raw = await read_body(receive, scope["headers"], MAX_BODY_BYTES, s.request_timeout_s)
            body = parse_client_body(raw, endpoint, orch.topology.model.name)
            ex = Exchange(endpoint, body, request_id=rid, session=_session_key(orch, scope, body),
                          tools=tools_of(endpoint, body))
            assert orch.flow is not None, "app not started"
            watch = _DisconnectWatch(scope, receive)
            response = await orch.flow.handle(ex)
            await response(scope, receive, send_with_id)
        except OrchestratorError as err:
            orch.metrics.errors.labels(kind=err.kind).inc()
            if err.status == 499:
                status = 499
            else:
                await err.answer()(scope, receive, send_with_id)
        except TimeoutError:
            orch.metrics.errors.labels(kind="bad_request").inc()
            await OrchestratorError(408, "request body not received in time").answer()(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - a bug must still answer in the OpenAI shape, and be logged
            log.exception("unexpected error on %s", endpoint)
            orch.metrics.errors.labels(kind="internal").inc()
            if not status:
                await OrchestratorError(500, "internal error in the orchestrator (see its log)").answer()(
                    scope, receive, send_with_id)
        except asyncio.CancelledError:
            if watch is None or not watch.disconnected:
                raise  # shutdown, not the client
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if not status:
                status = 499
                orch.metrics.errors.labels(kind="client_disconnected").inc()
            log.info("client disconnected from %s", endpoint)
    finally:
        if watch is not None:
            watch.stop()
        if admitted:
            orch.admission.leave()
        orch.metrics.child(orch.metrics.requests, endpoint, str(status or 500)).inc()
        request_id.current.reset(token)
