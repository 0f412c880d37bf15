"""A server got SIGTERM and tells the orchestrator: may its running streams move?

``POST /cluster/workers/drain {"url": ...}`` (admin token, like registration) is sent by a ctx or
gen server's frontend 0 when SIGTERM reaches it (``executor.drain_advice``; what Kubernetes or a
supervisor sends before stopping it). The orchestrator, which alone sees the whole cluster, answers
``{"mode": "move_kv" | "wait", "reason": ...}`` and stops routing new requests to the server:

- ``move_kv``: the server is a gen server, ``orchestrator.drain_mode`` is ``move_kv``,
  ``migration_limit`` > 0 (so its streams carry token ids and are marked movable) and another gen
  server is ready. The server then drains with ``move_kv`` itself: each movable stream ends with a
  ``moved`` event at its next decode step and the relay continues it on another gen server that
  pulls its KV (:meth:`orchestrator.migration.GenPhase.move`), exactly as a scale-down drain does.
- ``wait``: anything else (a ctx server, whose parked KV is pulled where it is; no other ready gen
  server; moves turned off). The server waits for its requests within ``engine.drain_grace_s``.

The same rule decides a scale-down drain (:meth:`orchestrator.fleet.Fleet.drain_mode_for`).
"""

from __future__ import annotations

import logging

from pdserve.config import OrchestratorSettings

from .pools import ClusterPools, Server

log = logging.getLogger("orchestrator.drain")


def move_kv_refusal(settings: OrchestratorSettings, pools: ClusterPools, member: Server) -> str | None:
    """Why ``member``'s running streams cannot move to another gen server now; None when they can."""
    if member.role != "gen":
        return "a ctx server's parked KV is pulled where it is"
    if settings.drain_mode != "move_kv":
        return "orchestrator.drain_mode is wait"
    if settings.migration_limit == 0:
        return "migration_limit is 0, so no stream is movable"
    if not [s for s in pools.pool("gen").ready() if s.url != member.url]:
        return "no other gen server is ready to take its requests"
    return None


def find_member(pools: ClusterPools, url: str) -> Server | None:
    """The member of either pool at ``url`` (None: not a member)."""
    return next((s for s in pools.all_servers() if s.url == url.rstrip("/")), None)


def answer_drain_notice(settings: OrchestratorSettings, pools: ClusterPools, member: Server) -> dict:
    """Decide how ``member`` drains (the body of the answer: ``mode``, ``reason``) and route nothing
    new to it. A member already retiring (scale-down: ``draining``) keeps that state; any other is
    marked unhealthy until a health poll sees it serve again (its replacement, if one starts)."""
    why = move_kv_refusal(settings, pools, member)
    mode = "move_kv" if why is None else "wait"
    reason = why or "another gen server is ready: running streams move there with their KV"
    if not member.draining:
        member.mark_unhealthy(f"draining after SIGTERM ({mode})")
    log.info("%s %s got SIGTERM: it drains with %s (%s)", member.name, member.url, mode, reason)
    return {"mode": mode, "reason": reason}
