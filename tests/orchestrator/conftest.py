"""Fixtures: a cluster of fake ctx/gen servers plus a real orchestrator app, all on 127.0.0.1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.serve_options import SERVE_OPTIONS
from pdserve.config import Topology, parse_topology

from orch_fakes import KV_LAYOUT, MODEL, Behavior, Record, ThreadServer, bind_socket, make_fake_server


@dataclass
class FakeNode:
    server: ThreadServer
    behavior: Behavior
    record: Record


@dataclass
class Cluster:
    url: str
    topology: Topology
    ctx: list[FakeNode]
    gen: list[FakeNode]
    orchestrator: ThreadServer
    _servers: list[ThreadServer] = field(default_factory=list)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                return
            time.sleep(0.02)
        raise TimeoutError("orchestrator did not become ready")

    def stop(self) -> None:
        for s in self._servers:  # all at once: each uvicorn takes ~0.1 s to notice
            s.server.should_exit = True
        for s in self._servers:
            s.stop()


def make_topology(ctx_ports: list[int], gen_ports: list[int], orch_port: int, model: dict | None = None,
                  **orch: object) -> Topology:
    settings = {"host": "127.0.0.1", "port": orch_port, "health_interval_s": 0.05, "connect_timeout_s": 1.0,
                "request_timeout_s": 10.0, **orch}
    return parse_topology({
        "model": {"name": MODEL, **(model or {})},
        "orchestrator": settings,
        "pools": {"ctx": {"servers": [{"port": p} for p in ctx_ports]},
                  "gen": {"servers": [{"port": p} for p in gen_ports]}},
    })


@pytest.fixture
def make_cluster():
    """``make_cluster(n_ctx=1, n_gen=1, wait=True, layouts=None, behaviors=None, model=None, **orchestrator_settings)``.

    ``layouts={"gen": [{"block_size": 32}]}``: KV layout fields of gen server 0 that differ from
    :data:`orch_fakes.KV_LAYOUT` (what its ``/server_info`` reports); ``None``: no ``/server_info``.
    ``behaviors={"ctx": [{"max_model_len": 512}]}``: :class:`orch_fakes.Behavior` fields of ctx
    server 0, set before it starts. ``model``: more ``model:`` keys (e.g. ``{"tool_call_parser": "hermes"}``).
    """
    clusters: list[Cluster] = []

    def factory(n_ctx: int = 1, n_gen: int = 1, wait: bool = True, layouts: dict[str, list[dict | None]] | None = None,
                behaviors: dict[str, list[dict]] | None = None, model: dict | None = None, **orch: object) -> Cluster:
        nodes = {}
        servers: list[ThreadServer] = []
        for role, n in (("ctx", n_ctx), ("gen", n_gen)):
            nodes[role] = []
            overrides = (layouts or {}).get(role, [])
            for i in range(n):
                beh, rec = Behavior(), Record()
                if i < len(overrides):
                    beh.kv_layout = None if overrides[i] is None else {**KV_LAYOUT, **overrides[i]}
                for key, value in ((behaviors or {}).get(role, [])[i:i + 1] or [{}])[0].items():
                    setattr(beh, key, value)
                srv = ThreadServer(make_fake_server(role, beh, rec)).start()
                servers.append(srv)
                nodes[role].append(FakeNode(srv, beh, rec))
        sock = bind_socket()
        topo = make_topology([n.server.port for n in nodes["ctx"]], [n.server.port for n in nodes["gen"]],
                             sock.getsockname()[1], model, **orch)
        orch_srv = ThreadServer(create_app(topo), sock, http=SERVE_OPTIONS["http"]).start()
        servers.append(orch_srv)
        cluster = Cluster(orch_srv.url, topo, nodes["ctx"], nodes["gen"], orch_srv, servers)
        clusters.append(cluster)
        if wait:
            cluster.wait_ready()
        return cluster

    yield factory
    for c in clusters:
        c.stop()


@pytest.fixture
def cluster(make_cluster) -> Cluster:
    return make_cluster()
