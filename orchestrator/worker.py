"""A worker's part of an orchestrator process group (processes 1..K-1; see
:mod:`orchestrator.process_group`).

A worker serves the hot path itself, with its own routers, upstream client and metrics:
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``
(503 while its view of the owner is older than :data:`~orchestrator.feed.STALE_VIEW_S`). Its
pools mirror the owner's (:class:`~orchestrator.feed.FeedClient`). Every other route —
registration and heartbeats, deregistration, scaling, ``/cluster/status``, ``/metrics`` (the
owner sums every process), ``/reset_prefix_cache`` — is **forwarded** to the owner over its unix
socket: method, path, query, headers (the admin token included) and body as received; the
owner's answer is relayed as it is. Bounded: :data:`FORWARD_TIMEOUT_S` per call (above the
owner's own longest control call, a prefix-cache reset of 10 s); an unreachable owner is a 503.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import httpx
from starlette.types import Receive, Scope, Send

from .errors import OrchestratorError
from .feed import FeedClient
from .front import OPENAI_PATHS, read_body
from .owner import METRICS_PATH
from .process_group import WORKER_HEADER, ProcessSpec, internal_allowed
from .responses import JSONAnswer

if TYPE_CHECKING:
    from .app import Orchestrator

log = logging.getLogger("orchestrator.worker")

LOCAL_PATHS = OPENAI_PATHS | {"/v1/models", "/health"}
FORWARD_TIMEOUT_S = 30.0
FORWARD_MAX_BODY_BYTES = 1 << 20  # control bodies are small
_HOP_HEADERS = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding",
                          b"te", b"upgrade", b"proxy-connection"})
_DROP_ANSWER_HEADERS = _HOP_HEADERS | {WORKER_HEADER, b"content-encoding"}


class WorkerSide:
    """What a worker adds to its :class:`~orchestrator.app.Orchestrator`."""

    def __init__(self, orch: "Orchestrator", spec: ProcessSpec) -> None:
        self.spec = spec
        self._orch = orch
        self.feed = FeedClient(spec, orch.pools, orch.settings.worker_feed_interval_s,
                               kv_hits=lambda: {pool: h.as_dict() for pool, h in orch.selfcheck.pools.items()})
        self._owner = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=spec.socket_path(0)),
                                        timeout=FORWARD_TIMEOUT_S, trust_env=False)

    async def start(self) -> None:
        """Serve only once the owner's membership is known (raises TimeoutError otherwise)."""
        await self.feed.first_view()
        self.feed.start()

    async def stop(self) -> None:
        await self.feed.stop()
        await self._owner.aclose()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer what a worker does not serve like a single process; False: the app serves it."""
        path = scope["path"]
        if path.startswith("/internal/"):
            if path == METRICS_PATH and internal_allowed(scope, self.spec):
                body = self._orch.render_metrics()
                headers = [(b"content-type", self._orch.metrics.content_type.encode()),
                           (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            else:
                await JSONAnswer({"error": {"message": "Not Found"}}, 404)(scope, receive, send)
            return True
        if path == "/health" and self.feed.stale:
            await OrchestratorError(503, "not ready: no recent membership view from the orchestrator's owner "
                                         "process").answer()(scope, receive, send)
            return True
        if path in LOCAL_PATHS:
            return False
        await self.forward(scope, receive, send)
        return True

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one request to the owner and its answer back (see the module docstring)."""
        try:
            body = await read_body(receive, scope["headers"], FORWARD_MAX_BODY_BYTES, FORWARD_TIMEOUT_S)
        except OrchestratorError as err:
            if err.status != 499:  # 499: the client left, nobody to answer
                await err.answer()(scope, receive, send)
            return
        except TimeoutError:
            await OrchestratorError(408, "request body not received in time").answer()(scope, receive, send)
            return
        target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        query = scope.get("query_string") or b""
        url = "http://owner" + target + ("?" + query.decode("latin-1") if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_HEADERS]
        try:
            resp = await self._owner.request(scope["method"], url, headers=headers, content=body)
        except httpx.HTTPError as err:
            log.warning("forwarding %s %s to the owner failed: %r", scope["method"], scope["path"], err)
            await OrchestratorError(503, f"the orchestrator's owner process did not answer ({type(err).__name__}); "
                                         "retry", kind="owner_unreachable").answer()(scope, receive, send)
            return
        out = [(k.lower(), v) for k, v in resp.headers.raw if k.lower() not in _DROP_ANSWER_HEADERS]
        out.append((b"content-length", str(len(resp.content)).encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        await send({"type": "http.response.body", "body": resp.content})
