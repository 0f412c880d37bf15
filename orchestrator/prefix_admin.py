"""``POST /reset_prefix_cache`` on the orchestrator: reset every server's prefix cache.

Fans out to every ready or draining member of both pools (the admin token is forwarded as the
orchestrator's own, from ``orchestrator.admin_token_env``) and answers per server:
``{"freed_blocks": total, "servers": {url: {"freed_blocks": n} | {"error": "..."}}, "skipped":
{url: state}}`` with 200 when every server asked answered, 502 when one did not. ``skipped`` names
the members that were not asked (starting, unhealthy, stopped: not serving, or not reachable),
with their state, so a caller knows whose cache may still hold blocks. Each call is bounded by
:data:`RESET_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.auth import admin_token, auth_headers, check_bearer

from .errors import error_response
from .pools import ROLES, Server, ServerState

RESET_TIMEOUT_S = 10.0  # a server answers between engine steps; one long prefill step can take seconds


async def _reset_one(client: httpx.AsyncClient, server: Server, env: str) -> dict:
    try:
        resp = await client.post(f"{server.url}/reset_prefix_cache", headers=auth_headers(env),
                                 timeout=RESET_TIMEOUT_S)
    except httpx.HTTPError as err:
        return {"error": f"{type(err).__name__}: {err}"}
    if resp.status_code != 200:
        return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
    return {"freed_blocks": int(resp.json().get("freed_blocks", 0))}


def add_prefix_cache_routes(app: FastAPI, orch) -> None:
    """Install the route on the orchestrator's app (``orch``: :class:`orchestrator.app.Orchestrator`)."""
    env = orch.settings.admin_token_env

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        refused = check_bearer(request.headers.get("authorization"), admin_token(env), env)
        if refused is not None:
            orch.metrics.errors.labels(kind="unauthorized").inc()
            return error_response(refused[0], refused[1])
        members = [s for role in ROLES for s in orch.pools.pool(role).servers]
        servers = [s for s in members if s.state in (ServerState.READY, ServerState.DRAINING)]
        skipped = {s.url: s.state.value for s in members if s not in servers}
        answers = await asyncio.gather(*(_reset_one(orch.client, s, env) for s in servers))
        per_server = {s.url: a for s, a in zip(servers, answers)}
        total = sum(a.get("freed_blocks", 0) for a in answers)
        failed = any("error" in a for a in answers)
        return JSONResponse({"freed_blocks": total, "servers": per_server, "skipped": skipped},
                            status_code=502 if failed else 200)
