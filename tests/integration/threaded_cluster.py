"""A tiny cluster in the test process on real sockets: a ctx and a gen server (tiny random Llama,
``engine.executor: inproc``, KV over TCP) and the orchestrator, each a uvicorn in a thread.

Starts in seconds (no MPI ranks, no subprocesses) and speaks real HTTP, so the official ``openai``
client can talk to it. ``stop()`` ends every server it started.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from executor.http_server import create_server_app
from executor.server_main import build_inproc_state
from orchestrator.app import create_app
from orchestrator.serve_options import SERVE_OPTIONS
from pdserve.config import load_topology
from tests.integration.procs import write_topology
from tests.orchestrator.orch_fakes import ThreadServer

MODEL = "tiny-llama"


def _socket_on(port: int) -> socket.socket:
    """A socket bound to 127.0.0.1:``port`` (the topology's free port) for uvicorn."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@contextmanager
def env_vars(values: dict[str, str]):
    """Set environment variables for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"orchestrator {url} not ready within {timeout_s} s")


@dataclass
class ThreadedCluster:
    """``url`` (orchestrator), ``server_url(role)``; :meth:`stop` stops the servers and engines."""

    url: str
    servers: dict[str, ThreadServer]
    topology: object = None  # pdserve.config.Topology the servers were built from

    def add_orchestrator(self, name: str, timeout_s: float = 60.0, **settings) -> str:
        """Start another orchestrator over the same servers with ``settings`` overriding the
        topology's ``orchestrator:`` (e.g. ``schedule_style="generation_first"``); its URL.
        Stopped by :meth:`stop` with the rest."""
        sock = _socket_on(0)
        orch = self.topology.orchestrator.model_copy(update={**settings, "port": sock.getsockname()[1]})
        server = ThreadServer(create_app(self.topology.model_copy(update={"orchestrator": orch})), sock,
                              http=SERVE_OPTIONS["http"])
        self.servers[name] = server.start(timeout_s)
        _wait_healthy(server.url, timeout_s)
        return server.url

    def server_url(self, role: str) -> str:
        return self.servers[role].url

    @classmethod
    def start(cls, model_dir: Path, work_dir: Path, pools: dict | None = None,
              orchestrator: dict | None = None, timeout_s: float = 60.0, num_gen: int = 1,
              model: dict | None = None) -> "ThreadedCluster":
        """``pools``: extra keys per pool (e.g. ``{"gen": {"api_key_env": "K"}}``). ``num_gen`` gen
        servers: ``servers["gen"]``, ``servers["gen1"]``, ...; ``model``: more ``model:`` keys
        (e.g. ``{"tool_call_parser": "hermes"}``)."""
        path = write_topology(work_dir / "threaded.yaml", str(model_dir), MODEL, num_gen=num_gen,
                              engine={"executor": "inproc", "num_kv_blocks": 256},
                              kv_transfer={"backend": "tcp", "lease_ms": 10000},
                              orchestrator={"health_interval_s": 0.05, "max_local_prefill_length": 0,
                                            **(orchestrator or {})})
        doc = yaml.safe_load(path.read_text())
        for role, extra in (pools or {}).items():
            doc["pools"][role].update(extra)
        doc["model"].update(model or {})
        path.write_text(yaml.safe_dump(doc))
        topo = load_topology(path)
        servers: dict[str, ThreadServer] = {}
        try:
            for role, i in [("ctx", 0)] + [("gen", i) for i in range(num_gen)]:
                cfg = topo.server_config(role, i).model_copy(update={"orchestrator_url": ""})
                app = create_server_app(build_inproc_state(cfg))
                servers[role if i == 0 else f"{role}{i}"] = ThreadServer(app, _socket_on(cfg.port)).start(timeout_s)
            servers["orchestrator"] = ThreadServer(create_app(topo), _socket_on(topo.orchestrator.port),
                                                       http=SERVE_OPTIONS["http"]).start(timeout_s)
            cluster = cls(servers["orchestrator"].url, servers, topo)
            cluster.wait_ready(timeout_s)
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
        return cluster

    def wait_ready(self, timeout_s: float) -> None:
        _wait_healthy(self.url, timeout_s)

    def stop(self) -> None:
        for s in self.servers.values():  # all at once: each uvicorn takes ~0.1 s to notice
            s.server.should_exit = True
        for s in self.servers.values():
            s.stop()
