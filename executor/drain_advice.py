"""SIGTERM on a cluster member: ask the orchestrator how to drain.

Who decides: the orchestrator. A server alone cannot tell whether another gen server is ready to
take its streams (a stream moved with nowhere to go would fail), nor whether the orchestrator
follows its streams' token ids (``migration_limit`` > 0, which is what makes them ``movable``);
the orchestrator knows both. So on SIGTERM frontend 0 first stops admitting, then posts
``POST {orchestrator}/cluster/workers/drain {"url": <its advertised URL>}`` (the admin token, as
its registration) and drains as answered (:mod:`orchestrator.drain_notice`):
``{"mode": "move_kv"}`` → the engine moves every movable stream at its next decode step
(``EngineClient.drain(move_kv=True)``: KV parked here, the stream ended with a ``moved`` event that
the orchestrator continues elsewhere); ``{"mode": "wait"}``, any other answer, no answer within
``CALL_TIMEOUT_S``, or a server that never registered with an orchestrator → it waits for its
requests within ``engine.drain_grace_s``, as before. The notice also stops the orchestrator
routing new requests here at once, instead of at its next failed health poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdserve.auth import auth_headers

log = logging.getLogger("pdserve.drain")

CALL_TIMEOUT_S = 2.0  # one notice; SIGTERM's grace is for the requests, not for this call


@dataclass(frozen=True)
class DrainAdvice:
    """How to drain: ``mode`` ``"move_kv"`` or ``"wait"``; ``reason`` says why, for the log."""

    mode: str
    reason: str


class DrainAdvisor:
    """Asks the orchestrator at ``target`` how the server at ``url`` drains (see the module docstring).

    ``token_env``: the variable holding the admin token (``orchestrator.admin_token_env``).
    ``is_member()``: whether the server has registered there (no notice otherwise).
    ``transport``: an httpx transport for tests (None: the network).
    """

    def __init__(self, target: str, url: str, token_env: str, is_member: Callable[[], bool],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.target, self.url, self.token_env = target.rstrip("/"), url, token_env
        self._is_member, self._transport = is_member, transport

    async def ask(self) -> DrainAdvice:
        """The orchestrator's answer; ``wait`` with the reason when there is none (never raises)."""
        if not self._is_member():
            return DrainAdvice("wait", "not a member of an orchestrator-fronted cluster")
        try:
            async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S, trust_env=False, transport=self._transport) as client:
                resp = await client.post(f"{self.target}/cluster/workers/drain", json={"url": self.url},
                                         headers=auth_headers(self.token_env))
        except httpx.HTTPError as err:
            return DrainAdvice("wait", f"the orchestrator {self.target} did not answer: {type(err).__name__}: {err}")
        try:
            doc = resp.json() if resp.status_code == 200 else None
        except ValueError:
            doc = None
        mode = doc.get("mode") if isinstance(doc, dict) else None
        if mode not in ("move_kv", "wait"):
            return DrainAdvice("wait", f"the orchestrator answered HTTP {resp.status_code}: {resp.text[:200]}")
        return DrainAdvice(mode, str(doc.get("reason", "")))
