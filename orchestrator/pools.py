"""Pool membership: the ctx and gen servers, their health state and in-flight load.

A member comes from one of three sources:

* ``static``: listed in the topology with ``launcher.kind: external`` (someone else runs it);
  it stays a member whatever happens and is only marked unhealthy.
* ``registered``: it joined by ``POST /cluster/workers``; it is dropped when it misses its
  heartbeat TTL or fails ``health_failure_threshold`` polls in a row, and may register again.
* ``managed``: the orchestrator's launcher started it (:mod:`orchestrator.fleet`); the launcher
  restarts it when its process dies and removes it when the pool shrinks.

A :class:`HealthPoller` owned by the app lifespan polls every member's ``GET /health``; a member
that fails a request is marked unhealthy at once and stays so until its next good poll. A
draining member gets no new requests (the router never picks it) while its in-flight ones finish.

KV layout check at join time: before a member turns ready (and whenever it comes back), its
``kv_layout`` (from ``GET /server_info`` or its registration body) is compared with every member
already accepted, of both pools (:func:`pdserve.kv_pairing.join_mismatch`). So the first member
accepted fixes the cluster's layout for as long as an accepted member remains. A member that cannot
pair is ``incompatible``: never routed to, its reason in ``last_error``, re-checked on every poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import httpx

from pdserve.config import Role, Topology
from pdserve.kv_pairing import join_layout, join_mismatch

from .tasks import LoopTask

log = logging.getLogger("orchestrator.pools")

ROLES: tuple[Role, Role] = ("ctx", "gen")
Source = Literal["static", "registered", "managed"]


class ServerState(str, enum.Enum):
    UNKNOWN = "unknown"      # not polled yet (a launched server that is still loading)
    READY = "ready"          # last /health answered 200
    UNHEALTHY = "unhealthy"  # last poll failed, or a request to it failed since
    DRAINING = "draining"    # being removed: no new requests, in-flight ones finish
    INCOMPATIBLE = "incompatible"  # healthy, but its KV layout cannot pair with the cluster's


@dataclass
class Server:
    """One pool member. ``in_flight`` counts requests the orchestrator has open on it: those of
    this process (``local_in_flight``) plus, with ``orchestrator.num_workers`` > 1, those the other
    orchestrator processes reported (``remote_in_flight``, set by :mod:`orchestrator.feed`)."""

    role: Role
    index: int
    url: str
    source: Source = "static"
    state: ServerState = ServerState.UNKNOWN
    local_in_flight: int = 0
    remote_in_flight: int = 0
    served: int = 0
    failures: int = 0                       # consecutive failed health polls
    last_error: str | None = None
    last_poll_s: float | None = field(default=None, repr=False)
    last_heartbeat_s: float | None = field(default=None, repr=False)
    instance_id: str | None = None          # set by the launcher / the registration body
    info: dict = field(default_factory=dict, repr=False)  # what the server said when registering
    joined_s: float = field(default_factory=time.monotonic, repr=False)
    kv_layout: dict | None = field(default=None, repr=False)  # None: not known (not reported)
    layout_ok: bool = field(default=False, repr=False)  # accepted by the join-time layout check
    max_model_len: int | None = None        # context window (tokens) it reports; None: not known
    warned_reason: str | None = field(default=None, repr=False)  # the last incompatibility logged

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"

    @property
    def in_flight(self) -> int:
        """Requests open on this server from every orchestrator process (what routers compare)."""
        return self.local_in_flight + self.remote_in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        # Only this process's own count changes: ``in_flight += 1`` opens one request here.
        self.local_in_flight += value - self.in_flight

    @property
    def draining(self) -> bool:
        return self.state is ServerState.DRAINING

    def mark_ready(self) -> None:
        self.failures = 0
        if self.draining:
            return
        if self.state is not ServerState.READY:
            log.info("%s %s is ready", self.name, self.url)
        self.state = ServerState.READY
        self.last_error = None

    def mark_unhealthy(self, reason: str) -> None:
        self.last_error = reason
        if self.draining:
            return
        if self.state is not ServerState.UNHEALTHY:
            log.warning("%s %s is unhealthy: %s", self.name, self.url, reason)
        self.state = ServerState.UNHEALTHY

    def mark_incompatible(self, reason: str) -> None:
        """Healthy but unusable: its KV layout cannot pair with the cluster's (logged once per reason)."""
        self.failures = 0
        self.layout_ok = False
        self.last_error = reason
        if self.draining:
            return
        if reason != self.warned_reason:
            log.warning("%s %s is refused: %s", self.name, self.url, reason)
            self.warned_reason = reason
        self.state = ServerState.INCOMPATIBLE

    def start_draining(self) -> None:
        log.info("%s %s is draining (%d in flight)", self.name, self.url, self.in_flight)
        self.state = ServerState.DRAINING

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one in-flight request on this server for the duration of the block."""
        self.in_flight += 1
        self.served += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def note_max_model_len(self, value: object) -> None:
        """Record the context window a server reported (``/server_info`` or its registration)."""
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            self.max_model_len = value

    def snapshot(self) -> dict:
        """What another orchestrator process needs to route to this member (JSON-able; the
        wire format of :mod:`orchestrator.feed`)."""
        return {"role": self.role, "index": self.index, "url": self.url, "source": self.source,
                "state": self.state.value, "failures": self.failures, "last_error": self.last_error,
                "instance_id": self.instance_id, "kv_layout": self.kv_layout, "layout_ok": self.layout_ok,
                "max_model_len": self.max_model_len}

    def apply_snapshot(self, snap: dict) -> None:
        """Take the owner's view of this member (:meth:`snapshot`); local counters are kept."""
        self.index, self.source = int(snap["index"]), snap["source"]
        self.state = ServerState(snap["state"])
        self.failures, self.last_error = int(snap["failures"]), snap["last_error"]
        self.instance_id, self.kv_layout = snap["instance_id"], snap["kv_layout"]
        self.layout_ok, self.max_model_len = bool(snap["layout_ok"]), snap["max_model_len"]

    def status(self) -> dict:
        return {"name": self.name, "url": self.url, "source": self.source, "state": self.state.value,
                "in_flight": self.in_flight, "served": self.served, "failures": self.failures,
                "instance_id": self.instance_id, "pid": self.info.get("pid"), "last_error": self.last_error,
                "kv_layout": self.kv_layout, "max_model_len": self.max_model_len}


class Pool:
    """The servers of one role."""

    def __init__(self, role: Role, servers: list[Server], min_instances: int = 1) -> None:
        self.role = role
        self.servers = servers
        self.min_instances = min_instances
        self._next_index = len(servers)

    def ready(self) -> list[Server]:
        return [s for s in self.servers if s.state is ServerState.READY]

    def any_ready(self) -> bool:
        """Whether some server is ready (no list built: the per-request fail-fast check)."""
        for s in self.servers:
            if s.state is ServerState.READY:
                return True
        return False

    def get(self, url: str) -> Server | None:
        return next((s for s in self.servers if s.url == url), None)

    def by_instance(self, instance_id: str) -> Server | None:
        return next((s for s in self.servers if s.instance_id == instance_id), None)

    def add(self, url: str, source: Source, instance_id: str | None = None) -> Server:
        """A new member (state unknown until its first good poll)."""
        server = Server(self.role, self._next_index, url, source, instance_id=instance_id)
        self._next_index += 1
        self.servers.append(server)
        log.info("%s %s joined the %s pool (%s)", server.name, url, self.role, source)
        return server

    def remove(self, server: Server, reason: str) -> None:
        if server in self.servers:
            self.servers.remove(server)
            log.warning("%s %s left the %s pool: %s", server.name, server.url, self.role, reason)

    def counts(self) -> dict[str, int]:
        """Number of servers per state, plus ``total``."""
        out = {st.value: 0 for st in ServerState}
        for s in self.servers:
            out[s.state.value] += 1
        out["total"] = len(self.servers)
        return out


class ClusterPools:
    """Both pools of a cluster."""

    def __init__(self, ctx: Pool, gen: Pool) -> None:
        self.ctx = ctx
        self.gen = gen

    @classmethod
    def from_topology(cls, topology: Topology) -> "ClusterPools":
        """Static members (``launcher.kind: external``); launched ones are added by the fleet."""
        pools = {}
        for role in ROLES:
            settings = topology.pool(role)
            servers = []
            if topology.launcher.kind == "external":
                servers = [Server(role, i, topology.server_url(role, i)) for i in range(len(settings.servers))]
            pools[role] = Pool(role, servers, settings.min_instances)
        return cls(pools["ctx"], pools["gen"])

    def pool(self, role: Role) -> Pool:
        return self.ctx if role == "ctx" else self.gen

    def all_servers(self) -> list[Server]:
        return self.ctx.servers + self.gen.servers

    def accepted_dtype(self) -> str | None:
        """The KV dtype the accepted members report (they all agree: the join check), or ``None``
        before any member with a layout was accepted. ``engine.dtype: auto`` resolves on each
        server's CPU, so this, not the topology, is what names the servers' KV blocks."""
        for server in self.all_servers():
            if server.layout_ok and server.kv_layout and isinstance(server.kv_layout.get("dtype"), str):
                return server.kv_layout["dtype"]
        return None

    def layout_conflict(self, server: Server) -> str | None:
        """Why ``server``'s KV layout cannot pair with the accepted members, or ``None``. Members of
        the other pool are checked first; an unknown layout is not checked."""
        layout = server.kv_layout
        if not layout:
            return None
        members = self.pool("gen" if server.role == "ctx" else "ctx").servers + self.pool(server.role).servers
        others = [s for s in members if s is not server and s.layout_ok and s.kv_layout]
        for other in others:
            same_role = other.role == server.role
            reason = join_mismatch(layout, other.kv_layout, server.name if same_role else server.role,
                                   other.name if same_role else other.role)
            if reason is not None:
                return f"{reason} ({server.name} {server.url} cannot pair with {other.name} {other.url})"
        return None

    def admit(self, server: Server) -> bool:
        """Turn a healthy ``server`` ready if its KV layout pairs with the accepted members, else
        mark it incompatible. Returns whether it was accepted."""
        reason = self.layout_conflict(server)
        if reason is not None:
            server.mark_incompatible(reason)
            return False
        if server.kv_layout is None and not server.layout_ok and server.state is not ServerState.READY:
            log.info("%s %s reports no kv_layout; its KV pairing is not checked", server.name, server.url)
        server.layout_ok = server.kv_layout is not None
        server.warned_reason = None
        server.mark_ready()
        return True

    def not_ready_reason(self) -> str | None:
        """``None`` when every pool has at least ``max(1, min_instances)`` ready servers."""
        missing = []
        for role in ROLES:
            p = self.pool(role)
            need = max(1, p.min_instances)
            if len(p.ready()) < need:
                states = ", ".join(f"{s.url} {s.state.value}"
                                   + (f" ({s.last_error})" if s.state is ServerState.INCOMPATIBLE else "")
                                   for s in p.servers) or "no members"
                missing.append(f"{role} pool has {len(p.ready())} of {need} ready servers ({states})")
        return "; ".join(missing) or None

    def status(self) -> dict:
        return {role: [s.status() for s in self.pool(role).servers] for role in ROLES}

    def max_model_len(self) -> int | None:
        """The context window (tokens) a request can use through this cluster: the smallest one
        reported by a ready ctx or gen server (a request passes one of each); ``None`` if none is known."""
        known = [s.max_model_len for s in self.ready_servers() if s.max_model_len is not None]
        return min(known) if known else None

    def ready_servers(self) -> list[Server]:
        return self.ctx.ready() + self.gen.ready()


class HealthPoller:
    """Polls ``GET /health`` of every member every ``interval_s`` seconds, expires heartbeats.

    Owned by the app lifespan: :meth:`start` creates the task, :meth:`stop` cancels and awaits it.
    Each poll is bounded by ``timeout_s``. A ``registered`` member is dropped after
    ``failure_threshold`` failed polls in a row or when its last heartbeat is older than ``ttl_s``.
    """

    def __init__(self, pools: ClusterPools, client: httpx.AsyncClient, interval_s: float, timeout_s: float,
                 failure_threshold: int = 3, ttl_s: float = 10.0) -> None:
        self._pools = pools
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._failure_threshold = failure_threshold
        self._ttl_s = ttl_s
        self._loop = LoopTask("orchestrator-health-poller")

    def start(self) -> None:
        self._loop.start(self._run())

    async def stop(self) -> None:
        await self._loop.stop()

    async def poll_once(self) -> None:
        """Poll every member once, concurrently; admit the healthy ones that were not ready (layout
        check, in pool order: ctx first, so a ctx and a gen that come up together are judged the
        same way every time); then drop the registered ones that are gone."""
        servers = self._pools.all_servers()
        joining = await asyncio.gather(*(self._poll(s) for s in servers))
        for server, join in zip(servers, joining):
            if join and server in self._pools.pool(server.role).servers and not server.draining:
                self._pools.admit(server)
        now = time.monotonic()
        for server in self._pools.all_servers():
            if server.source != "registered":
                continue
            if server.failures >= self._failure_threshold:
                self._pools.pool(server.role).remove(server, f"{server.failures} failed health polls "
                                                             f"({server.last_error})")
            elif server.last_heartbeat_s is not None and now - server.last_heartbeat_s > self._ttl_s:
                self._pools.pool(server.role).remove(server, f"no heartbeat for {now - server.last_heartbeat_s:.1f} s "
                                                             f"(TTL {self._ttl_s:g} s)")

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad poll
                log.exception("health poll failed")
            await asyncio.sleep(self._interval_s)

    async def _poll(self, server: Server) -> bool:
        """Poll ``server``'s health; True when it is healthy but must pass the layout check first
        (it was not ready: then its ``/server_info`` has just been read again)."""
        server.last_poll_s = time.monotonic()
        try:
            resp = await self._client.get(f"{server.url}/health", timeout=self._timeout_s)
        except httpx.HTTPError as err:
            server.failures += 1
            server.mark_unhealthy(f"/health: {type(err).__name__}: {err}".rstrip(": "))
            return False
        if resp.status_code != 200:
            server.failures += 1
            server.mark_unhealthy(f"/health answered HTTP {resp.status_code}")
            return False
        if server.state in (ServerState.READY, ServerState.DRAINING):
            server.mark_ready()
            return False
        try:  # joining or coming back (maybe restarted with another config): read its layout again
            info = await self._client.get(f"{server.url}/server_info", timeout=self._timeout_s)
        except httpx.HTTPError as err:
            # Healthy but slow to describe itself: judge it by the layout known already (from an
            # earlier poll or its registration); with none, it waits (not a health failure).
            if server.kv_layout is not None:
                return True
            server.last_error = f"/server_info: {type(err).__name__}: {err}".rstrip(": ")
            return False
        body = None
        if info.status_code == 200:
            with contextlib.suppress(ValueError):
                body = info.json()
        if isinstance(body, dict):
            server.note_max_model_len(body.get("max_model_len"))
        if isinstance(body, dict) and isinstance(body.get("kv_layout"), dict):
            server.kv_layout = join_layout(body["kv_layout"], body.get("kv_layouts"))
        return True  # with no layout in the answer, keep what its registration said (if anything)
