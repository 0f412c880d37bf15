"""Prometheus metrics of one orchestrator app (its own CollectorRegistry, so apps never share).

What a request records on its way (latencies, request and routing counts) lives in
:mod:`orchestrator.loop_metrics` (lock-free, same exposition); the rest is ``prometheus_client``'s.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .loop_metrics import LoopCounter, LoopHistogram
from .pools import ROLES, ClusterPools, ServerState

_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """Counters and histograms; all times in seconds, measured at the orchestrator."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}
        r = self.registry
        self.requests = LoopCounter("pdserve_orchestrator_requests", "Client requests by endpoint and HTTP status",
                                    ["endpoint", "status"], registry=r)
        self.errors = Counter("pdserve_orchestrator_errors", "Errors by kind (ctx_failed, gen_stream, ...)",
                              ["kind"], registry=r)
        self.ttft = LoopHistogram("pdserve_orchestrator_ttft_seconds",
                                  "Time from request arrival to the first response byte sent to the client",
                                  ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = LoopHistogram("pdserve_orchestrator_e2e_latency_seconds",
                                 "Time from request arrival to the last response byte", ["endpoint"],
                                 buckets=_LATENCY_BUCKETS_S, registry=r)
        self.ctx_phase = LoopHistogram("pdserve_orchestrator_ctx_phase_seconds",
                                       "Duration of the context phase (all attempts)", buckets=_LATENCY_BUCKETS_S,
                                       registry=r)
        self.tpot = LoopHistogram("pdserve_orchestrator_time_per_output_token_seconds",
                                  "Per request: (last byte - first byte) / (output chunks - 1), streams only",
                                  ["endpoint"], buckets=_TOKEN_BUCKETS_S, registry=r)
        self.itl = LoopHistogram("pdserve_orchestrator_inter_token_latency_seconds",
                                 "Gap between consecutive stream chunks relayed to the client",
                                 ["endpoint"], buckets=_TOKEN_BUCKETS_S, registry=r)
        self.queue = LoopHistogram("pdserve_orchestrator_queue_time_seconds",
                                   "Arrival to the first upstream request (validation, tokenizing, routing)",
                                   buckets=_TOKEN_BUCKETS_S, registry=r)
        self.kv_handoff = LoopHistogram("pdserve_orchestrator_kv_transfer_seconds",
                                        "Streaming requests: ctx answer to the gen server's first byte (KV pull + first "
                                        "decode step; a non-streaming gen answer has no first byte before its last)",
                                        buckets=_LATENCY_BUCKETS_S, registry=r)
        self.routed = LoopCounter("pdserve_orchestrator_routed_requests", "Requests sent to a server, by pool and path",
                                  ["pool", "path"], registry=r)
        self.retries = Counter("pdserve_orchestrator_retries", "Attempts repeated on another server, by pool",
                               ["pool"], registry=r)
        self.migrations = Counter("pdserve_orchestrator_migrations", "Streams continued on another gen server "
                                  "after theirs died mid-decode", registry=r)
        self.moves = Counter("pdserve_orchestrator_kv_moves", "Streams continued on another gen server that "
                             "pulled their KV from a gen server draining with move_kv", registry=r)
        self.relayed_events = LoopCounter("pdserve_orchestrator_relayed_events",
                                          "Gen stream events read by the relay, by how: passed (pass-through, the "
                                          "server's bytes) or merged (parsed and rewritten here)", ["how"], registry=r)
        self.pool_servers = Gauge("pdserve_orchestrator_pool_servers", "Servers per pool and state",
                                  ["pool", "state"], registry=r)
        self.pool_in_flight = Gauge("pdserve_orchestrator_pool_in_flight_requests",
                                    "Requests the orchestrator has open on the pool's servers", ["pool"], registry=r)
        self.pool_target = Gauge("pdserve_orchestrator_pool_target_instances",
                                 "Target size of the pool (launched clusters)", ["pool"], registry=r)
        self.processes = Gauge("pdserve_orchestrator_processes",
                               "Orchestrator processes whose series this exposition sums (orchestrator.num_workers)",
                               registry=r)
        self.processes.set(1)

    def child(self, metric: Counter | Histogram | LoopCounter | LoopHistogram, *labels: str):
        """``metric.labels(*labels)``, cached: the hot path records ~8 samples per request and
        prometheus_client's ``labels()`` validates and locks on every call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self, pools: ClusterPools, targets: dict[str, int] | None = None) -> bytes:
        """The text exposition, with the pool gauges refreshed first."""
        for role in ROLES:
            pool = pools.pool(role)
            counts = pool.counts()
            for st in ServerState:
                self.pool_servers.labels(pool=role, state=st.value).set(counts[st.value])
            # This process's own requests only: /metrics of several processes sums them.
            self.pool_in_flight.labels(pool=role).set(sum(s.local_in_flight for s in pool.servers))
            if targets is not None:
                self.pool_target.labels(pool=role).set(targets[role])
        return generate_latest(self.registry)

