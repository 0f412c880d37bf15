"""The orchestrator's FastAPI app: OpenAI endpoints, health, metrics and cluster status.

``create_app(topology)`` builds everything one app owns (pools, router, metrics, one
``httpx.AsyncClient``, the health poller, background tasks); the lifespan starts and stops them.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.config import Topology
from pdserve.protocol import ModelCard, ModelList, now_s

from .disagg import DisaggFlow, Exchange
from .errors import OrchestratorError, error_response
from .metrics import Metrics
from .pools import ClusterPools, HealthPoller
from .router import Router, make_router
from .tasks import TaskOwner
from .validation import parse_body, validation_message

log = logging.getLogger("orchestrator.app")

SHUTDOWN_TIMEOUT_S = 5.0


class Orchestrator:
    """State of one app. ``client`` and ``flow`` exist between :meth:`start` and :meth:`stop`."""

    def __init__(self, topology: Topology, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.topology = topology
        self.settings = topology.orchestrator
        self.pools = ClusterPools.from_topology(topology)
        self.router: Router = make_router(self.settings)
        self.metrics = Metrics()
        self.tasks = TaskOwner()
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self.poller: HealthPoller | None = None
        self.flow: DisaggFlow | None = None

    async def start(self) -> None:
        s = self.settings
        timeout = httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=128)
        # trust_env=False: a proxy from the environment must never sit between us and the servers.
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, transport=self._transport)
        # A poll must not outlive its period by much, nor wait longer than a connect would.
        health_timeout_s = min(s.connect_timeout_s, max(s.health_interval_s, 1.0))
        self.poller = HealthPoller(self.pools, self.client, s.health_interval_s, health_timeout_s)
        self.flow = DisaggFlow(self.pools, self.router, self.client, s, self.metrics, self.tasks)
        self.poller.start()

    async def stop(self) -> None:
        # Order: stop polling, let pending lease releases finish, then close the client they use.
        if self.poller is not None:
            await self.poller.stop()
        await self.tasks.close(SHUTDOWN_TIMEOUT_S)
        if self.client is not None:
            await self.client.aclose()


def create_app(topology: Topology, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The orchestrator app for ``topology``. ``transport`` replaces the network (tests)."""
    orch = Orchestrator(topology, transport)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await orch.start()
        try:
            yield
        finally:
            await orch.stop()

    app = FastAPI(title="pdserve orchestrator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.orchestrator = orch
    install_error_handlers(app)
    add_openai_routes(app, orch)
    add_cluster_routes(app, orch)
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; FastAPI's ``{"detail": ...}`` never does."""

    @app.exception_handler(OrchestratorError)
    async def _orchestrator_error(_: Request, err: OrchestratorError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(err.errors()))
        return error_response(422, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))


def add_openai_routes(app: FastAPI, orch: Orchestrator) -> None:
    async def serve(request: Request, endpoint: str) -> Response:
        status = 500
        try:
            body = parse_body(await request.body(), endpoint, orch.topology.model.name)
            assert orch.flow is not None, "app not started"
            response = await orch.flow.handle(Exchange(endpoint, body))
            status = response.status_code
            return response
        except OrchestratorError as err:
            status = err.status
            orch.metrics.errors.labels(kind=err.kind).inc()
            return err.response()
        finally:
            orch.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions")

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=orch.topology.model.name, created=now_s())]).model_dump()


def add_cluster_routes(app: FastAPI, orch: Orchestrator) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        reason = orch.pools.not_ready_reason()
        if reason is not None:
            return error_response(503, f"not ready: {reason}")
        pools = {role: orch.pools.pool(role).counts() for role in ("ctx", "gen")}
        return JSONResponse({"status": "ok", "pools": pools})

    @app.get("/cluster/status")
    async def cluster_status() -> dict:
        return {"model": orch.topology.model.name, "pools": orch.pools.status()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(orch.metrics.render(orch.pools), media_type=orch.metrics.content_type)
