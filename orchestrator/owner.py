"""The owner's part of an orchestrator process group (process 0; see :mod:`orchestrator.process_group`).

Besides everything a single orchestrator does (its app serves every route), the owner:

* starts, watches and restarts the workers (:class:`~orchestrator.process_group.WorkerSupervisor`);
* answers their feed (``POST /internal/feed``, :class:`~orchestrator.feed.FeedHub`), which keeps
  its members' ``remote_in_flight`` (the workers' open requests) for its own routers, its
  ``/cluster/status`` and the scale-down drain;
* answers ``GET /metrics`` with the sum over every process (:mod:`orchestrator.metrics_sum`): it
  scrapes each live worker's ``GET /internal/metrics`` on the worker's unix socket (bounded by
  :data:`SCRAPE_TIMEOUT_S`; a worker that does not answer is left out and
  ``pdserve_orchestrator_processes`` says how many were summed).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

import httpx
from starlette.types import Receive, Scope, Send

from .errors import OrchestratorError
from .feed import FEED_PATH, FeedHub, WorkerReport
from .front import read_body
from .metrics_sum import sum_expositions
from .process_group import TOKEN_HEADER, ProcessSpec, WorkerSupervisor, internal_allowed
from .responses import JSONAnswer

if TYPE_CHECKING:
    from .app import Orchestrator

log = logging.getLogger("orchestrator.owner")

METRICS_PATH = "/internal/metrics"
SCRAPE_TIMEOUT_S = 2.0
FEED_MAX_BODY_BYTES = 1 << 20
STOP_GRACE_S = 10.0  # > a worker's graceful shutdown (5 s) plus its lifespan stop


class OwnerSide:
    """What process 0 adds to its :class:`~orchestrator.app.Orchestrator` (``payload``: what each
    worker is started with, its topology and log level)."""

    def __init__(self, orch: "Orchestrator", spec: ProcessSpec, payload: dict) -> None:
        self.spec = spec
        self._orch = orch
        self.hub = FeedHub(orch.pools)
        self.supervisor = WorkerSupervisor(spec, payload, orch.settings.worker_max_restarts,
                                           on_exit=self.hub.forget, on_tick=self.hub.refresh)
        self._peers: dict[int, httpx.AsyncClient] = {}

    def start(self) -> None:
        self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop(STOP_GRACE_S)
        await asyncio.gather(*(c.aclose() for c in self._peers.values()))

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer the routes the owner serves differently from a single process; False: not one."""
        path = scope["path"]
        if path.startswith("/internal/"):
            if not internal_allowed(scope, self.spec):
                await JSONAnswer({"error": {"message": "Not Found"}}, 404)(scope, receive, send)
            elif path == FEED_PATH:
                try:
                    raw = await read_body(receive, scope["headers"], FEED_MAX_BODY_BYTES, 5.0)
                    answer = JSONAnswer(self.hub.receive(WorkerReport.from_json(raw)))
                except (OrchestratorError, TimeoutError, ValueError, KeyError, TypeError, AttributeError) as err:
                    answer = JSONAnswer({"error": {"message": f"bad feed report: {err!r}"}}, 400)
                await answer(scope, receive, send)
            else:
                await self._answer_metrics(self._orch.render_metrics(), scope, receive, send)
            return True
        if path == "/metrics" and scope["method"] == "GET":
            await self._answer_metrics(await self.metrics(), scope, receive, send)
            return True
        return False

    async def metrics(self) -> bytes:
        """The exposition summed over the owner and every worker that answered."""
        indices = self.supervisor.live_indices()
        texts = await asyncio.gather(*(self._scrape(i) for i in indices))
        answered = [t for t in texts if t is not None]
        self._orch.metrics.processes.set(1 + len(answered))
        own = self._orch.render_metrics()
        try:
            return sum_expositions([own, *answered])
        except ValueError:  # a worker's text did not parse: answer the owner's own rather than nothing
            log.exception("summing the workers' metrics failed; answering the owner's alone")
            self._orch.metrics.processes.set(1)
            return self._orch.render_metrics()

    async def _scrape(self, index: int) -> bytes | None:
        client = self._peers.get(index)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=self.spec.socket_path(index))
            client = self._peers[index] = httpx.AsyncClient(transport=transport, timeout=SCRAPE_TIMEOUT_S,
                                                            trust_env=False)
        try:
            resp = await client.get(f"http://worker{METRICS_PATH}", headers={TOKEN_HEADER: self.spec.token})
        except httpx.HTTPError as err:
            log.warning("metrics of orchestrator worker %d not scraped: %r", index, err)
            return None
        return resp.content if resp.status_code == 200 else None

    async def _answer_metrics(self, body: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", self._orch.metrics.content_type.encode()),
                   (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def status(self) -> list[dict]:
        """Every process of the group: the owner, then each worker (pid, alive, restarts, and from
        its last report: age in s and requests open)."""
        reports = self.hub.status()
        workers = [{"role": "worker", **w, **{k: v for k, v in reports.get(w["index"], {}).items() if k != "pid"}}
                   for w in self.supervisor.status()]
        return [{"index": 0, "role": "owner", "pid": os.getpid(), "alive": True}, *workers]
