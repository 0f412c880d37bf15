"""A tiny cluster inside the test process: ctx and gen server apps (tiny random Llama, engine in a
thread) and an orchestrator app whose HTTP client reaches them through ASGI, with no sockets
except the KV transfer's own TCP listener."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx

from executor.http_server import ServerState, create_server_app
from executor.server_main import build_inproc_state
from orchestrator.app import create_app
from pdserve.config import load_topology
from tests.integration.procs import write_topology

MODEL = "tiny-llama"


class AppsTransport(httpx.AsyncBaseTransport):
    """Routes each request to the ASGI app registered for its ``host:port``; others fail to connect."""

    def __init__(self, apps: dict[str, object]) -> None:
        self.routes = {addr: httpx.ASGITransport(app=app, raise_app_exceptions=False) for addr, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        route = self.routes.get(f"{request.url.host}:{request.url.port}")
        if route is None:
            raise httpx.ConnectError(f"no app at {request.url.host}:{request.url.port}", request=request)
        return await route.handle_async_request(request)


@dataclass
class InProcessCluster:
    """``apps[kind]`` for kind in ("orchestrator", "ctx", "gen"); :meth:`close` stops the engines."""

    apps: dict[str, object]
    states: dict[str, ServerState]

    @classmethod
    def start(cls, model_dir: Path, work_dir: Path) -> "InProcessCluster":
        topo_path = write_topology(work_dir / "fuzz.yaml", str(model_dir), MODEL,
                                   engine={"executor": "inproc", "num_kv_blocks": 512},
                                   kv_transfer={"backend": "tcp", "lease_ms": 5000},
                                   orchestrator={"health_interval_s": 0.05, "max_local_prefill_length": 0})
        topo = load_topology(topo_path)
        states, apps, routes = {}, {}, {}
        for role in ("ctx", "gen"):
            cfg = topo.server_config(role, 0)
            states[role] = build_inproc_state(cfg)
            for start in states[role].on_startup:
                start()
            apps[role] = routes[f"{cfg.host}:{cfg.port}"] = create_server_app(states[role])
        apps["orchestrator"] = create_app(topo, transport=AppsTransport(routes))
        return cls(apps, states)

    def close(self) -> None:
        async def stop() -> None:
            for state in self.states.values():
                for hook in reversed(state.on_shutdown):
                    result = hook()
                    if asyncio.iscoroutine(result):
                        await result

        asyncio.run(stop())


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 20.0) -> None:
    """Poll ``/health`` until 200. Raises TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if (await client.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{client.base_url} not ready within {timeout_s} s")
