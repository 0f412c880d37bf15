"""The orchestrator's FastAPI app: OpenAI endpoints, health, metrics and cluster status.

``create_app(topology)`` builds everything one app owns (pools, router, metrics, one
``httpx.AsyncClient``, the health poller, background tasks); the lifespan starts and stops them.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pydantic import BaseModel, ConfigDict, Field

from pdserve.api_keys import bearer_headers, is_protected, load_api_key, refusal, send_refusal
from pdserve.asgi_guard import ErrorBoundary
from pdserve.auth import admin_token, check_bearer
from pdserve.config import Role, Topology
from pdserve.kv_pairing import join_layout
from pdserve.protocol import ModelCard, ModelList, now_s

from .admission import Admission
from .disagg import DisaggFlow
from .drain_notice import answer_drain_notice, find_member
from .gen_first import GenerationFirstFlow
from .errors import OrchestratorError, error_response
from .front import OPENAI_PATHS, serve_openai
from .h1client import H1Client
from .httpx_upstream import HttpxUpstream
from .metrics import Metrics
from .owner import OwnerSide
from .process_group import ProcessSpec, tag_answers
from .worker import WorkerSide
from .fleet import Backend, Fleet, ScaleError
from .kv_feed import KVEventFeeds, httpx_opener
from .kv_index import KVIndexes
from .kv_selfcheck import HitSelfCheck
from .pools import ROLES, ClusterPools, HealthPoller
from .prefix_admin import add_prefix_cache_routes
from .prompt_tokens import PromptTokenizer
from .router import Router, make_routers
from .tokenize_proxy import add_tokenize_routes
from .tasks import TaskOwner
from .validation import validation_message

log = logging.getLogger("orchestrator.app")

SHUTDOWN_TIMEOUT_S = 5.0
KV_EVENTS_READ_TIMEOUT_S = 5.0  # servers send a heartbeat every second; 5 s of silence is a broken stream


class Orchestrator:
    """State of one app. ``client`` (httpx, control plane: health polls, tokenizer, fleet),
    ``upstream`` (the hot path's :class:`H1Client`) and ``flow`` exist between :meth:`start` and
    :meth:`stop`.

    ``config_path`` (the topology file) is what launched servers read; it is needed when
    ``launcher.kind`` is ``local`` or ``slurm`` (then the app owns a :class:`Fleet`).
    """

    def __init__(self, topology: Topology, transport: httpx.AsyncBaseTransport | None = None,
                 config_path: str | Path | None = None, backend: Backend | None = None,
                 group: ProcessSpec | None = None, group_payload: dict | None = None) -> None:
        self.topology = topology
        self.settings = topology.orchestrator
        self.config_path = config_path
        self.pools = ClusterPools.from_topology(topology)
        self.kv_indexes = KVIndexes()  # what each member's KV events say it holds
        self.routers: dict[str, Router] = make_routers(topology, self.kv_indexes)
        self.metrics = Metrics()
        self.selfcheck = HitSelfCheck(self.kv_indexes, topology.pool_engine("ctx").block_size, self.metrics.registry)
        self.kv_feeds: KVEventFeeds | None = None
        self.tasks = TaskOwner()
        self.admission = Admission(self.settings.max_inflight_requests, self.settings.retry_after_s)
        self.upstream: H1Client | HttpxUpstream | None = None
        self._transport = transport
        self._backend = backend
        self.client: httpx.AsyncClient | None = None
        self.poller: HealthPoller | None = None
        self.flow: DisaggFlow | None = None
        self.fleet: Fleet | None = None
        self.tokenizer: PromptTokenizer | None = None
        # Client API key (orchestrator.api_key_env) and the key each pool's servers require; both
        # read once here, so an exported-nowhere key fails at start (MissingApiKey), not per request.
        self.api_key = load_api_key(self.settings.api_key_env)
        self.upstream_auth = {role: bearer_headers(load_api_key(topology.pool(role).api_key_env)) for role in ROLES}
        # orchestrator.num_workers > 1: this process's part of the group (None: the one process).
        self.side: OwnerSide | WorkerSide | None = None
        if group is not None:
            self.side = OwnerSide(self, group, group_payload or {}) if group.is_owner else WorkerSide(self, group)

    @property
    def wants_kv_events(self) -> bool:
        """Whether a pool routes on held blocks (then every member's KV events are followed)."""
        return any(self.topology.pool_router(role) == "kv_cache_aware" for role in ROLES)

    @property
    def needs_tokens(self) -> bool:
        return self.settings.max_local_prefill_length > 0 or any(r.needs_tokens for r in self.routers.values())

    async def start(self) -> None:
        s = self.settings
        timeout = httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=128)
        # trust_env=False: a proxy from the environment must never sit between us and the servers.
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, transport=self._transport)
        # A poll must not outlive its period by much, nor wait longer than a connect would.
        health_timeout_s = min(s.connect_timeout_s, max(s.health_interval_s, 1.0))
        self.poller = HealthPoller(self.pools, self.client, s.health_interval_s, health_timeout_s,
                                   s.health_failure_threshold, s.heartbeat_ttl_s)
        if self.needs_tokens:
            self.tokenizer = PromptTokenizer(self.client, [self.pools.gen, self.pools.ctx])
        # A test transport replaces the network on the hot path too; otherwise the lean client.
        self.upstream = H1Client(s.connect_timeout_s) if self._transport is None else HttpxUpstream(self.client)
        ctx_engine = self.topology.pool_engine("ctx")
        flow = GenerationFirstFlow if s.schedule_style == "generation_first" else DisaggFlow
        self.flow = flow(self.pools, self.routers, self.upstream, s, self.metrics, self.tasks, self.tokenizer,
                         ctx_engine.block_size, self.topology.model.name, ctx_engine.dtype, self.selfcheck,
                         auth=self.upstream_auth,
                         parsers=(self.topology.model.tool_call_parser, self.topology.model.reasoning_parser))
        if self.wants_kv_events:  # every process routes, so each follows the KV events itself
            opener = httpx_opener(self.client, s.connect_timeout_s, KV_EVENTS_READ_TIMEOUT_S)
            self.kv_feeds = KVEventFeeds(self.pools, self.kv_indexes, opener, min(s.health_interval_s, 0.5))
            self.kv_feeds.start()
        if isinstance(self.side, WorkerSide):  # membership, polls and launching are the owner's
            await self.side.start()
            return
        backend = self._backend or make_backend(self.topology, self.config_path)
        if backend is not None:
            self.fleet = Fleet(self.topology, self.pools, backend, self.client, self.tasks)
            if os.environ.get("PDSERVE_EXPECT_STARTED") == "1":  # slurm/pdserve.sbatch starts the first servers
                self.fleet.expect_started(s.startup_timeout_s)
            self.fleet.start()
        self.poller.start()
        if self.side is not None:
            self.side.start()

    async def stop(self) -> None:
        # Order: stop the other orchestrator processes (or this worker's feed), stop polling, stop
        # launched servers, let pending lease releases finish, then close the client they use.
        if self.side is not None:
            await self.side.stop()
        if self.poller is not None:
            await self.poller.stop()
        if self.kv_feeds is not None:
            await self.kv_feeds.stop(SHUTDOWN_TIMEOUT_S)
        if self.fleet is not None:
            await self.fleet.stop()
        await self.tasks.close(SHUTDOWN_TIMEOUT_S)
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.client is not None:
            await self.client.aclose()

    def render_metrics(self) -> bytes:
        """This process's own Prometheus exposition (the pool gauges refreshed first)."""
        targets = self.fleet.targets if self.fleet is not None else None
        return self.metrics.render(self.pools, targets)

    def status(self) -> dict:
        pools = {}
        for role in ROLES:
            pool = self.pools.pool(role)
            p = self.topology.pool(role)
            info = {"router": self.topology.pool_router(role), "min_instances": p.min_instances,
                    "max_instances": p.max_instances, "ready": len(pool.ready()),
                    "in_flight": sum(s.in_flight for s in pool.servers),
                    "servers": [self._server_status(s) for s in pool.servers],
                    "kv_hits": self._kv_hits(role)}
            if self.fleet is not None:
                info.update(self.fleet.pool_status(role))
            pools[role] = info
        out = {"model": self.topology.model.name, "launcher": self.topology.launcher.kind,
               "ready": self.pools.not_ready_reason() is None, "pools": pools}
        if isinstance(self.side, OwnerSide):
            out["processes"] = self.side.status()
        return out

    def _kv_hits(self, role: str) -> dict:
        """The router self-check totals of ``role``'s pool: this process's, plus every worker's
        (their feed reports) when this is the owner of a process group."""
        hits = self.selfcheck.pools[role].as_dict()
        if isinstance(self.side, OwnerSide):
            for key, value in self.side.hub.kv_hits(role).items():
                hits[key] = hits.get(key, 0) + value
        return hits

    def _server_status(self, server) -> dict:
        index = self.kv_indexes.find(server.url) if self.kv_feeds is not None else None
        return {**server.status(), "kv_index": index.status() if index is not None else None}


def make_backend(topology: Topology, config_path: str | Path | None) -> Backend | None:
    """The launcher backend ``launcher.kind`` names (None for ``external``)."""
    kind = topology.launcher.kind
    if kind == "external":
        return None
    if config_path is None:
        raise ValueError(f"launcher.kind {kind!r} needs the topology file path (python -m orchestrator --config FILE)")
    from .backends import LocalBackend, SlurmBackend

    return LocalBackend(topology, Path(config_path)) if kind == "local" else SlurmBackend(topology, Path(config_path))


def create_app(topology: Topology, *, transport: httpx.AsyncBaseTransport | None = None,
               config_path: str | Path | None = None, backend: Backend | None = None,
               group: ProcessSpec | None = None, group_payload: dict | None = None) -> FastAPI:
    """The orchestrator app for ``topology``. ``transport`` replaces the network (tests).
    ``group``: this process's place in a group of ``orchestrator.num_workers`` processes
    (:mod:`orchestrator.process_group`; ``group_payload``: what the owner starts workers with)."""
    orch = Orchestrator(topology, transport, config_path, backend, group, group_payload)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await orch.start()
        try:
            yield
        finally:
            await orch.stop()

    app = OrchestratorApp(title="pdserve orchestrator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.orchestrator = orch
    app.state.orchestrator = orch
    install_error_handlers(app)
    app.add_middleware(ErrorBoundary, name="orchestrator")
    add_openai_routes(app, orch)
    add_cluster_routes(app, orch)
    add_control_routes(app, orch)
    add_prefix_cache_routes(app, orch)  # POST /reset_prefix_cache (fans out to every server)
    add_tokenize_routes(app, orch)      # /tokenize, /detokenize, /v1/models/{id}, /version
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


class OrchestratorApp(FastAPI):
    """The FastAPI app, except that the OpenAI POST routes go straight to :func:`serve_openai`, and
    a protected route (:func:`pdserve.api_keys.is_protected`) without the client API key is
    answered 401 before either."""

    orchestrator: Orchestrator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.orchestrator.api_key
        if key is not None and scope["type"] == "http" and is_protected(scope["path"]):
            if (body := refusal(scope["headers"], key)) is not None:
                self.orchestrator.metrics.errors.labels(kind="unauthorized").inc()
                return await send_refusal(send, body)
        side = self.orchestrator.side
        if side is not None and scope["type"] == "http":  # one of K processes (K = 1 never gets here)
            send = tag_answers(send, side.spec.index)
            if await side.handle(scope, receive, send):
                return
        if scope["type"] == "http" and scope["path"] in OPENAI_PATHS:
            if scope["method"] == "POST":
                await serve_openai(self.orchestrator, scope, receive, send)
            else:
                err = OrchestratorError(405, "Method Not Allowed", headers=(("Allow", "POST"),))
                await err.answer()(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def add_openai_routes(app: FastAPI, orch: Orchestrator) -> None:
    """``GET /v1/models`` (the POST routes are served by :class:`OrchestratorApp` itself)."""

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=orch.topology.model.name, created=now_s(), max_model_len=orch.pools.max_model_len())
        return ModelList(data=[card]).model_dump()


def add_cluster_routes(app: FastAPI, orch: Orchestrator) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        reason = orch.pools.not_ready_reason()
        if reason is not None:
            return error_response(503, f"not ready: {reason}")
        pools = {role: orch.pools.pool(role).counts() for role in ROLES}
        return JSONResponse({"status": "ok", "pools": pools})

    @app.get("/cluster/status")
    async def cluster_status() -> dict:
        return orch.status()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(orch.render_metrics(), media_type=orch.metrics.content_type)


class WorkerRegistration(BaseModel):
    """``POST /cluster/workers``: a server joins (or heartbeats: the same body again)."""

    model_config = ConfigDict(extra="allow")
    role: Role
    url: str = Field(..., pattern=r"^https?://[^/]+$")
    model: str
    instance_id: str | None = None
    state: str | None = None


class DrainNotice(BaseModel):
    """``POST /cluster/workers/drain``: the member at ``url`` got SIGTERM and is draining."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(..., pattern=r"^https?://[^/]+$")


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instances: int = Field(..., ge=0)


def add_control_routes(app: FastAPI, orch: Orchestrator) -> None:
    """Membership (registration/heartbeat) and scaling. Both need the admin token when one is
    configured; scaling is refused when none is (see :mod:`pdserve.auth`)."""
    env = orch.settings.admin_token_env

    def refuse(request: Request, open_when_unset: bool) -> JSONResponse | None:
        refused = check_bearer(request.headers.get("authorization"), admin_token(env), env, open_when_unset)
        if refused is None:
            return None
        orch.metrics.errors.labels(kind="unauthorized").inc()
        return error_response(refused[0], refused[1])

    @app.post("/cluster/workers")
    async def register(request: Request, body: WorkerRegistration) -> JSONResponse:
        if (denied := refuse(request, open_when_unset=True)) is not None:
            return denied
        if body.model != orch.topology.model.name:
            return error_response(409, f"{body.url} serves {body.model!r}; this cluster serves {orch.topology.model.name!r}")
        pool = orch.pools.pool(body.role)
        member = pool.get(body.url) or (pool.by_instance(body.instance_id) if body.instance_id else None)
        if member is None:
            inst = orch.fleet.knows(body.instance_id) if orch.fleet is not None else None
            member = pool.add(body.url, "managed" if inst else "registered", body.instance_id)
            if inst is not None:
                orch.fleet.joined(inst, member)
            elif orch.fleet is not None:
                orch.fleet.note_registered(body.role)
        member.url = body.url
        pid = (body.model_extra or {}).get("pid")
        if pid is not None and member.info.get("pid") not in (None, pid):
            # A new process at this address (a restart): the polls that failed were its
            # predecessor's, so its registration (sent once its port accepts) admits it now,
            # not at the next good health poll.
            member.failures = 0
        member.info = body.model_dump()
        member.last_heartbeat_s = time.monotonic()
        extra = body.model_extra or {}
        member.note_max_model_len(extra.get("max_model_len"))
        if isinstance(extra.get("kv_layout"), dict):
            layout = join_layout(extra["kv_layout"], extra.get("kv_layouts"))
            known = member.kv_layout or {}
            if "total_kv_heads" not in layout and "total_kv_heads" in known:  # learnt from /server_info
                layout["total_kv_heads"] = known["total_kv_heads"]
            if layout != known:
                member.kv_layout, member.layout_ok = layout, False
        if not member.draining:
            # A server whose KV layout cannot pair with the accepted members stays a member (it
            # shows in /cluster/status as incompatible) but is refused: 409 on every heartbeat.
            if (reason := orch.pools.layout_conflict(member)) is not None:
                member.mark_incompatible(reason)
                return error_response(409, reason, param="kv_layout")
            if body.state == "serving" and member.failures == 0:
                orch.pools.admit(member)  # it registers only once its port accepts and its engine serves
        return JSONResponse({"name": member.name, "state": member.state.value,
                             "heartbeat_interval_s": orch.settings.heartbeat_ttl_s / 3})

    @app.delete("/cluster/workers")
    async def deregister(request: Request, url: str) -> JSONResponse:
        if (denied := refuse(request, open_when_unset=True)) is not None:
            return denied
        for role in ROLES:
            member = orch.pools.pool(role).get(url)
            if member is None:
                continue
            if member.source == "registered":
                orch.pools.pool(role).remove(member, "deregistered")
            else:
                member.mark_unhealthy("deregistered (shutting down)")
            return JSONResponse({"removed": member.source == "registered"})
        return error_response(404, f"no member {url}")

    @app.post("/cluster/workers/drain")
    async def drain_notice(request: Request, body: DrainNotice) -> JSONResponse:
        """A member got SIGTERM: how it drains (``{"mode", "reason"}``, :mod:`orchestrator.drain_notice`)."""
        if (denied := refuse(request, open_when_unset=True)) is not None:
            return denied
        member = find_member(orch.pools, body.url)
        if member is None:
            return error_response(404, f"no member {body.url}")
        return JSONResponse(answer_drain_notice(orch.settings, orch.pools, member))

    @app.post("/cluster/pools/{pool}/scale")
    async def scale(request: Request, pool: str, body: ScaleRequest) -> JSONResponse:
        if (denied := refuse(request, open_when_unset=False)) is not None:
            return denied
        if pool not in ROLES:
            return error_response(404, f"no pool {pool!r} (ctx, gen)")
        if orch.fleet is None:
            return error_response(409, "launcher.kind is external: the orchestrator does not start servers here; "
                                       "start or stop them yourself (they register with POST /cluster/workers)")
        try:
            return JSONResponse(orch.fleet.scale(pool, body.instances), status_code=202)  # type: ignore[arg-type]
        except ScaleError as err:
            return error_response(400, str(err), param="instances")
