"""Router policies: which server of a pool gets the next request.

A router implements ``pick(pool, exclude, hint) -> Server | None`` over the pool's *ready*
servers (draining and unhealthy ones are never picked), skipping the URLs in ``exclude`` (servers
already tried for this request). ``None`` means no candidate is left. ``hint`` carries what the
orchestrator knows about the prompt (its KV block hashes); routers that do not need it ignore it.

* ``round_robin``: cycles through the candidates.
* ``least_loaded``: fewest in-flight requests (ties: round robin).
* ``kv_cache_aware``: the server whose recent requests share the longest prefix of KV blocks with
  this prompt (its prefix cache / parked blocks are likely warm there), ties broken by load; when
  that server has ``balance_threshold`` more in-flight requests than the least loaded one, or the
  best match covers less than ``min_match_ratio`` (half) of the prompt's blocks, load wins. Each server's block hashes are kept in a bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.block_hash import BlockHasher
from pdserve.config import Topology

from .pools import Pool, Server

MAX_TRACKED_BLOCKS = 65536  # per server


@dataclass(frozen=True)
class RouteHint:
    """What a router may know about a request: the chained hashes of its full prompt blocks."""

    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0


def block_hashes(token_ids: list[int], block_size: int, model: str = "", dtype: str = "",
                 cache_salt: str | None = None) -> tuple[bytes, ...]:
    """Chained hashes of the full ``block_size`` blocks of ``token_ids``: the servers' prefix-cache
    block names (:mod:`pdserve.block_hash`) when ``model``/``dtype`` are the cluster's."""
    return tuple(BlockHasher(model, dtype, block_size).hashes(token_ids, cache_salt))


class Router(Protocol):
    needs_tokens: bool

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None: ...


def _candidates(pool: Pool, exclude: set[str]) -> list[Server]:
    return [s for s in pool.ready() if s.url not in exclude]


class _Rotation:
    """A cursor that takes turns among a list of equally good servers."""

    def __init__(self) -> None:
        self._cursor = 0

    def next(self, servers: list[Server]) -> Server | None:
        if not servers:
            return None
        i, self._cursor = self._cursor, self._cursor + 1
        return servers[i % len(servers)]


class RoundRobinRouter:
    """Cycles through the ready servers of a pool."""

    needs_tokens = False

    def __init__(self) -> None:
        self._turns = _Rotation()

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        return self._turns.next(_candidates(pool, exclude))


class LeastLoadedRouter:
    """Fewest in-flight requests; round robin among equals so an idle pool still spreads."""

    needs_tokens = False

    def __init__(self) -> None:
        self._turns = _Rotation()

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        candidates = _candidates(pool, exclude)
        if not candidates:
            return None
        low = min(s.in_flight for s in candidates)
        return self._turns.next([s for s in candidates if s.in_flight == low])


@dataclass
class _Seen:
    blocks: OrderedDict = field(default_factory=OrderedDict)

    def match(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > MAX_TRACKED_BLOCKS:
            self.blocks.popitem(last=False)


class KVCacheAwareRouter:
    """Prefix block-hash affinity, ties broken by load (see the module docstring)."""

    needs_tokens = True

    def __init__(self, balance_threshold: int = 4, min_match_ratio: float = 0.5) -> None:
        self.balance_threshold = balance_threshold
        self.min_match_ratio = min_match_ratio
        self._seen: dict[str, _Seen] = {}
        self._fallback = LeastLoadedRouter()

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        candidates = _candidates(pool, exclude)
        if not candidates:
            return None
        self._forget_gone(pool)
        if hint is None or not hint.block_hashes:
            return self._fallback.pick(pool, exclude)
        low = min(s.in_flight for s in candidates)
        scored = [(self._seen.setdefault(s.url, _Seen()).match(hint.block_hashes), -s.in_flight, s)
                  for s in candidates]
        match, neg_load, best = max(scored, key=lambda t: (t[0], t[1]))
        # A short shared head (a chat template, a one-line system prompt) is not worth affinity:
        # below min_match_ratio of the prompt's blocks, load decides.
        if match < self.min_match_ratio * len(hint.block_hashes) or -neg_load - low > self.balance_threshold:
            best = self._fallback.pick(pool, exclude)
        self._seen.setdefault(best.url, _Seen()).add(hint.block_hashes)
        return best

    def _forget_gone(self, pool: Pool) -> None:
        if len(self._seen) > 4 * max(1, len(pool.servers)) + 16:
            live = {s.url for s in pool.servers}
            for url in [u for u in self._seen if u not in live]:
                del self._seen[url]


def make_router(name: str, balance_threshold: int = 4) -> Router:
    """The router called ``name``. Raises ValueError for an unknown name."""
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_loaded":
        return LeastLoadedRouter()
    if name == "kv_cache_aware":
        return KVCacheAwareRouter(balance_threshold)
    raise ValueError(f"unknown router {name!r} (round_robin, least_loaded, kv_cache_aware)")


def make_routers(topology: Topology) -> dict[str, Router]:
    """One router per pool, as ``pools.<role>.router`` (default ``orchestrator.router``) says."""
    t = topology.orchestrator.kv_aware_balance_threshold
    return {role: make_router(topology.pool_router(role), t) for role in ("ctx", "gen")}
