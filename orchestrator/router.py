"""Router policies: which server of a pool gets the next request.

A router implements ``pick(pool, exclude) -> Server | None`` over the pool's *ready* servers,
skipping the URLs in ``exclude`` (servers already tried for this request). ``None`` means no
candidate is left. New policies (least_loaded, kv_cache_aware) implement the same method.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.config import OrchestratorSettings

from .pools import Pool, Server


class Router(Protocol):
    def pick(self, pool: Pool, exclude: set[str]) -> Server | None: ...


class RoundRobinRouter:
    """Cycles through the ready servers of each pool, one cursor per pool role."""

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def pick(self, pool: Pool, exclude: set[str]) -> Server | None:
        candidates = [s for s in pool.ready() if s.url not in exclude]
        if not candidates:
            return None
        i = self._cursor.get(pool.role, 0)
        self._cursor[pool.role] = i + 1
        return candidates[i % len(candidates)]


def make_router(settings: OrchestratorSettings) -> Router:
    """The router named by ``settings.router``. Raises ValueError for an unknown name."""
    if settings.router == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"orchestrator.router: unknown router {settings.router!r}")
