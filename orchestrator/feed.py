"""The owner <-> worker channel of an orchestrator process group (``orchestrator.num_workers`` > 1).

HTTP/1.1 on the owner's private unix socket (``orch0.sock``), one round trip per worker every
``orchestrator.worker_feed_interval_s`` (0.1 s):

    worker -> owner   POST /internal/feed   WorkerReport {worker, pid, in_flight: {url: n}, unhealthy: [[url, why]],
                                                          kv_hits: {pool: totals}}
    owner  -> worker  200                   OwnerView {servers: [Server.snapshot() + others_in_flight]}

* ``in_flight``: the requests this worker has open on each server. The owner sums the fresh
  reports into each member's ``remote_in_flight``; a report older than :data:`STALE_REPORTS_S`,
  or of a worker that exited, counts no more.
* ``unhealthy``: servers this worker saw fail a request since its last report; the owner marks
  them unhealthy before it answers (until their next good health poll, as for its own failures).
* ``kv_hits``: the worker's router self-check totals per pool (:class:`~orchestrator.kv_selfcheck.PoolHits`);
  the owner adds them to its own in ``/cluster/status`` (:meth:`FeedHub.kv_hits`).
* The view names every member with its state, KV layout and context window, and
  ``others_in_flight``: what every *other* process has open on it. The worker mirrors it into its
  own :class:`~orchestrator.pools.ClusterPools` (:func:`apply_view`), so its routers, ``/health``
  and ``/v1/models`` see the owner's membership and the cluster's load, at most one interval old.

Bounded: each round trip has a timeout (:data:`FEED_TIMEOUT_S`), the bodies are a few hundred
bytes per server, and the internal routes answer only on the unix socket and with the token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from . import jsonio
from .pools import ROLES, ClusterPools, Server, ServerState
from .process_group import TOKEN_HEADER, ProcessSpec
from .tasks import LoopTask

log = logging.getLogger("orchestrator.feed")

FEED_PATH = "/internal/feed"
FEED_TIMEOUT_S = 2.0
STALE_REPORTS_S = 2.0      # a worker silent this long no longer adds to the owner's load view
STALE_VIEW_S = 3.0         # a worker whose view is this old answers /health 503
FIRST_VIEW_TIMEOUT_S = 30.0


@dataclass
class WorkerReport:
    """What a worker tells the owner (the request body of ``POST /internal/feed``)."""

    worker: int
    pid: int
    in_flight: dict[str, int] = field(default_factory=dict)   # server url -> requests open on it here
    unhealthy: list[tuple[str, str]] = field(default_factory=list)  # (url, reason) seen failing
    kv_hits: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> PoolHits totals (tokens)

    def to_json(self) -> bytes:
        return jsonio.dumps({"worker": self.worker, "pid": self.pid, "in_flight": self.in_flight,
                             "unhealthy": [list(u) for u in self.unhealthy], "kv_hits": self.kv_hits})

    @classmethod
    def from_json(cls, raw: bytes) -> "WorkerReport":
        """Raises ValueError/KeyError/TypeError on a malformed body."""
        doc = jsonio.loads(raw)
        return cls(int(doc["worker"]), int(doc["pid"]), {str(k): int(v) for k, v in doc["in_flight"].items()},
                   [(str(u), str(why)) for u, why in doc["unhealthy"]],
                   {str(p): {str(k): int(v) for k, v in h.items()} for p, h in doc.get("kv_hits", {}).items()})


class FeedHub:
    """The owner's side: takes reports, keeps ``remote_in_flight`` of its members, answers views."""

    def __init__(self, pools: ClusterPools) -> None:
        self._pools = pools
        self._reports: dict[int, tuple[float, WorkerReport]] = {}

    def receive(self, report: WorkerReport) -> bytes:
        """Apply ``report`` and answer the view for its worker (the response body)."""
        for url, why in report.unhealthy:
            server = self._find(url)
            if server is not None:
                server.mark_unhealthy(f"worker {report.worker}: {why}")
        self._reports[report.worker] = (time.monotonic(), report)
        self.refresh()
        return self.view_for(report.worker)

    def forget(self, worker: int) -> None:
        """A worker exited: the requests it had open are gone with it."""
        self._reports.pop(worker, None)
        self.refresh()

    def refresh(self) -> None:
        """Recompute every member's ``remote_in_flight`` from the fresh reports."""
        now = time.monotonic()
        fresh = [r for t, r in self._reports.values() if now - t <= STALE_REPORTS_S]
        for server in self._pools.all_servers():
            server.remote_in_flight = sum(r.in_flight.get(server.url, 0) for r in fresh)

    def view_for(self, worker: int) -> bytes:
        own = self._reports.get(worker, (0.0, WorkerReport(worker, 0)))[1].in_flight
        servers = [{**s.snapshot(), "others_in_flight": s.in_flight - own.get(s.url, 0)}
                   for s in self._pools.all_servers()]
        return jsonio.dumps({"servers": servers})

    def status(self) -> dict[int, dict]:
        """Per worker that reported: its pid, the age of its last report (s), its open requests."""
        now = time.monotonic()
        return {i: {"pid": r.pid, "report_age_s": round(now - t, 3), "in_flight": sum(r.in_flight.values())}
                for i, (t, r) in self._reports.items()}

    def kv_hits(self, pool: str) -> dict[str, int]:
        """The workers' self-check totals of ``pool`` summed (tokens; {} before any report). Every
        known report counts, stale or not (the totals are cumulative); an exited worker's do not."""
        out: dict[str, int] = {}
        for _, r in self._reports.values():
            for key, value in r.kv_hits.get(pool, {}).items():
                out[key] = out.get(key, 0) + value
        return out

    def _find(self, url: str) -> Server | None:
        return next((s for s in self._pools.all_servers() if s.url == url), None)


def apply_view(pools: ClusterPools, servers: list[dict],
               keep_state: frozenset[str] | set[str] = frozenset()) -> tuple[list[Server], list[Server]]:
    """Mirror the owner's members into ``pools`` (same order; objects reused by URL, so the
    requests in flight keep counting on them). ``keep_state``: URLs whose local state is not
    overwritten (a failure this process saw that the owner has not heard of yet). Returns the
    (added, removed) servers: the hook for per-server subscriptions such as a KV-event index."""
    added, removed = [], []
    for role in ROLES:
        pool = pools.pool(role)
        known = {s.url: s for s in pool.servers}
        members = []
        for snap in (s for s in servers if s["role"] == role):
            server = known.pop(snap["url"], None)
            if server is None:
                server = Server(role, int(snap["index"]), snap["url"])
                added.append(server)
            state = server.state
            server.apply_snapshot(snap)
            if snap["url"] in keep_state:
                server.state = state
            server.remote_in_flight = int(snap["others_in_flight"])
            members.append(server)
        pool.servers[:] = members
        removed.extend(known.values())
    return added, removed


class FeedClient:
    """The worker's side: one loop task that reports and mirrors every ``interval_s`` seconds.

    ``listeners`` are called with (added, removed) servers after each change of membership:
    where a per-server subscription (the KV-event index) attaches in a worker process.
    """

    def __init__(self, spec: ProcessSpec, pools: ClusterPools, interval_s: float,
                 kv_hits: Callable[[], dict[str, dict[str, int]]] | None = None) -> None:
        self._spec, self._pools, self._interval_s = spec, pools, interval_s
        self._kv_hits = kv_hits  # this process's self-check totals per pool, sent with each report
        self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=spec.socket_path(0)),
                                         timeout=FEED_TIMEOUT_S, trust_env=False)
        self._view_state: dict[str, ServerState] = {}  # url -> the state the last view gave it
        self._loop = LoopTask(f"orchestrator-feed-{spec.index}")
        self.last_view_s: float | None = None
        self.listeners: list[Callable[[list[Server], list[Server]], None]] = []

    @property
    def stale(self) -> bool:
        return self.last_view_s is None or time.monotonic() - self.last_view_s > STALE_VIEW_S

    async def first_view(self, timeout_s: float = FIRST_VIEW_TIMEOUT_S) -> None:
        """Wait (bounded) for the owner's first view, so this process serves only once it knows the
        members. Raises TimeoutError naming the last failure."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.exchange()
                return
            except (httpx.HTTPError, ValueError, KeyError) as err:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no view from the owner within {timeout_s:g} s: {err!r}") from None
            await asyncio.sleep(min(self._interval_s, 0.1))

    def start(self) -> None:
        self._loop.start(self._run())

    async def stop(self) -> None:
        await self._loop.stop()
        await self._client.aclose()

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.exchange()
                if failing:
                    log.info("owner feed is back")
                failing = False
            except (httpx.HTTPError, ValueError, KeyError) as err:
                if not failing:  # logged once per outage, not ten times a second
                    log.warning("owner feed failed: %r (keeping the last view)", err)
                failing = True

    def report(self) -> WorkerReport:
        servers = self._pools.all_servers()
        unhealthy = [(s.url, s.last_error or "request failed") for s in servers
                     if s.state is ServerState.UNHEALTHY and self._view_state.get(s.url) is not ServerState.UNHEALTHY]
        return WorkerReport(self._spec.index, os.getpid(),
                            {s.url: s.local_in_flight for s in servers if s.local_in_flight}, unhealthy,
                            self._kv_hits() if self._kv_hits is not None else {})

    async def exchange(self) -> None:
        """One round trip: report, then mirror the answer. Raises httpx.HTTPError, ValueError or
        KeyError (malformed answer)."""
        report = self.report()
        resp = await self._client.post(f"http://owner{FEED_PATH}", content=report.to_json(),
                                       headers={TOKEN_HEADER: self._spec.token, "content-type": "application/json"})
        if resp.status_code != 200:
            raise ValueError(f"owner answered HTTP {resp.status_code}: {resp.text[:200]}")
        servers = jsonio.loads(resp.content)["servers"]
        reported = {url for url, _ in report.unhealthy}
        # A failure seen during this round trip is not in the view yet: keep it until the next report.
        pending = {s.url for s in self._pools.all_servers() if s.state is ServerState.UNHEALTHY
                   and self._view_state.get(s.url) is not ServerState.UNHEALTHY and s.url not in reported}
        added, removed = apply_view(self._pools, servers, pending)
        self._view_state = {snap["url"]: ServerState(snap["state"]) for snap in servers}
        self.last_view_s = time.monotonic()
        if added or removed:
            for listener in self.listeners:
                listener(added, removed)
