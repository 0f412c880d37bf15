"""Pool membership: the ctx and gen servers, their health state and in-flight load.

Members come from the topology (static). A :class:`HealthPoller` owned by the app lifespan polls
every server's ``GET /health``; a server that fails a request is marked unhealthy at once and stays
so until its next good poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from pdserve.config import Role, Topology

log = logging.getLogger("orchestrator.pools")

ROLES: tuple[Role, Role] = ("ctx", "gen")


class ServerState(str, enum.Enum):
    UNKNOWN = "unknown"      # not polled yet
    READY = "ready"          # last /health answered 200
    UNHEALTHY = "unhealthy"  # last poll failed, or a request to it failed since


@dataclass
class Server:
    """One pool member. ``in_flight`` counts requests the orchestrator has open on it."""

    role: Role
    index: int
    url: str
    state: ServerState = ServerState.UNKNOWN
    in_flight: int = 0
    last_error: str | None = None
    last_poll_s: float | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"

    def mark_ready(self) -> None:
        if self.state is not ServerState.READY:
            log.info("%s %s is ready", self.name, self.url)
        self.state = ServerState.READY
        self.last_error = None

    def mark_unhealthy(self, reason: str) -> None:
        if self.state is not ServerState.UNHEALTHY:
            log.warning("%s %s is unhealthy: %s", self.name, self.url, reason)
        self.state = ServerState.UNHEALTHY
        self.last_error = reason

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one in-flight request on this server for the duration of the block."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def status(self) -> dict:
        return {"url": self.url, "state": self.state.value, "in_flight": self.in_flight,
                "last_error": self.last_error}


class Pool:
    """The servers of one role."""

    def __init__(self, role: Role, servers: list[Server]) -> None:
        self.role = role
        self.servers = servers

    def ready(self) -> list[Server]:
        return [s for s in self.servers if s.state is ServerState.READY]

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
        pools = {}
        for role in ROLES:
            specs = getattr(topology.pools, role).servers
            pools[role] = Pool(role, [Server(role, i, topology.server_url(role, i)) for i in range(len(specs))])
        return cls(pools["ctx"], pools["gen"])

    def pool(self, role: Role) -> Pool:
        return self.ctx if role == "ctx" else self.gen

    def all_servers(self) -> list[Server]:
        return self.ctx.servers + self.gen.servers

    def not_ready_reason(self) -> str | None:
        """``None`` when every pool has a ready server, else a message naming the empty pools."""
        missing = []
        for role in ROLES:
            p = self.pool(role)
            if not p.ready():
                states = ", ".join(f"{s.url} {s.state.value}" for s in p.servers)
                missing.append(f"{role} pool has no ready server ({states})")
        return "; ".join(missing) or None

    def status(self) -> dict:
        return {role: [s.status() for s in self.pool(role).servers] for role in ROLES}


class HealthPoller:
    """Polls ``GET /health`` of every server every ``interval_s`` seconds.

    Owned by the app lifespan: :meth:`start` creates the task, :meth:`stop` cancels and awaits it.
    Each poll is bounded by ``timeout_s``.
    """

    def __init__(self, pools: ClusterPools, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        self._pools = pools
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="orchestrator-health-poller")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def poll_once(self) -> None:
        """Poll every server once, concurrently."""
        await asyncio.gather(*(self._poll(s) for s in self._pools.all_servers()))

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._interval_s)

    async def _poll(self, server: Server) -> None:
        server.last_poll_s = time.monotonic()
        try:
            resp = await self._client.get(f"{server.url}/health", timeout=self._timeout_s)
        except httpx.HTTPError as err:
            server.mark_unhealthy(f"/health: {type(err).__name__}: {err}".rstrip(": "))
            return
        if resp.status_code == 200:
            server.mark_ready()
        else:
            server.mark_unhealthy(f"/health answered HTTP {resp.status_code}")
