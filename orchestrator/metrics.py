"""Prometheus metrics of one orchestrator app (its own CollectorRegistry, so apps never share)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .pools import ROLES, ClusterPools, ServerState

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """Counters and histograms; all times in seconds, measured at the orchestrator."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_orchestrator_requests", "Client requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("pdserve_orchestrator_errors", "Errors by kind (ctx_failed, gen_stream, ...)",
                              ["kind"], registry=r)
        self.ttft = Histogram("pdserve_orchestrator_ttft_seconds",
                              "Time from request arrival to the first response byte sent to the client",
                              ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdserve_orchestrator_e2e_latency_seconds",
                             "Time from request arrival to the last response byte", ["endpoint"],
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.ctx_phase = Histogram("pdserve_orchestrator_ctx_phase_seconds",
                                   "Duration of the context phase (all attempts)", buckets=_LATENCY_BUCKETS_S,
                                   registry=r)
        self.pool_servers = Gauge("pdserve_orchestrator_pool_servers", "Servers per pool and state",
                                  ["pool", "state"], registry=r)

    def render(self, pools: ClusterPools) -> bytes:
        """The text exposition, with the pool gauges refreshed first."""
        for role in ROLES:
            counts = pools.pool(role).counts()
            for st in ServerState:
                self.pool_servers.labels(pool=role, state=st.value).set(counts[st.value])
        return generate_latest(self.registry)
