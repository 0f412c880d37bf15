"""Router policies: which server of a pool gets the next request.

A router implements ``pick(pool, exclude, hint) -> Server | None`` over the pool's *ready*
servers (draining and unhealthy ones are never picked), skipping the URLs in ``exclude`` (servers
already tried for this request). ``None`` means no candidate is left. ``hint`` carries what the
orchestrator knows about the prompt (its KV block hashes); routers that do not need it ignore it.

* ``round_robin``: cycles through the candidates.
* ``least_loaded``: fewest in-flight requests (ties: round robin).
* ``power_of_two``: two candidates drawn at random, the one with fewer in-flight requests wins
  (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001): near
  least-loaded balance without every picker herding onto the same idle server.
* ``kv_cache_aware``: the server that holds the longest prefix of this prompt's KV blocks, by the
  blocks its prefix cache reported through its KV events (:mod:`orchestrator.kv_index`; a server
  without a synced index counts as holding none: load-only), ties broken by load; when that server
  has ``balance_threshold`` more in-flight requests than the least loaded one, or the best match
  covers less than ``min_match_ratio`` (half) of the prompt's blocks, load wins (least loaded).

Session affinity (``orchestrator.session_affinity``) wraps any of them: a request whose hint
names a session goes to the server that session last used while that server is a candidate and
not ``balance_threshold`` requests busier than the least loaded one; otherwise the inner policy
picks and the session moves there.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.block_hash import BlockHasher
from pdserve.config import Topology

from .kv_index import KVIndexes
from .pools import Pool, Server, ServerState

MAX_TRACKED_SESSIONS = 65536  # per pool


@dataclass
class RouteHint:
    """What a router may know about a request: the chained hashes of its full prompt blocks (a
    tuple, or :class:`orchestrator.prompt_blocks.PromptBlocks`, which hashes a block when it is
    first read), its prompt length in tokens, and its session-affinity key.

    ``pending``: the prompt's blocks are not computed yet (no server held a block when the request
    was routed, so no pick needed them: :meth:`orchestrator.disagg.DisaggFlow._route_hint`);
    :meth:`resolve` computes them (once) and fills this same object in, so every holder of the
    hint sees them; a pick reads a pending hint as holding no blocks (call :meth:`resolve`
    first where the pool's router :meth:`Router.holds_blocks`). One object per request: do not
    share it between requests."""

    block_hashes: Sequence[bytes] = ()
    num_tokens: int = 0
    session: str | None = None
    pending: Callable[[], tuple[Sequence[bytes], int] | None] | None = None

    def resolve(self) -> "RouteHint":
        """Fill in the pending blocks and length (a no-op when none are pending); returns self.
        A resolver that gives None (the prompt cannot be tokenized here) leaves them empty."""
        pending, self.pending = self.pending, None
        if pending is not None:
            found = pending()
            if found is not None:
                self.block_hashes, self.num_tokens = found
        return self


def block_hashes(token_ids: list[int], block_size: int, model: str = "", dtype: str = "",
                 cache_salt: str | None = None) -> tuple[bytes, ...]:
    """Chained hashes of the full ``block_size`` blocks of ``token_ids``: the servers' prefix-cache
    block names (:mod:`pdserve.block_hash`) when ``model``/``dtype`` are the cluster's."""
    return tuple(BlockHasher(model, dtype, block_size).hashes(token_ids, cache_salt))


class Router(Protocol):
    needs_tokens: bool

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None: ...

    def holds_blocks(self, pool: Pool) -> bool:
        """Whether a pick in ``pool`` may depend on the prompt's blocks now (some ready server's KV
        index holds a block); False: every pick now is the same whatever the prompt."""
        ...


def _no_blocks(pool: Pool) -> bool:
    return False


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
    holds_blocks = staticmethod(_no_blocks)

    def __init__(self) -> None:
        self._turns = _Rotation()

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        return self._turns.next(_candidates(pool, exclude))


class LeastLoadedRouter:
    """Fewest in-flight requests; round robin among equals so an idle pool still spreads."""

    needs_tokens = False
    holds_blocks = staticmethod(_no_blocks)

    def __init__(self) -> None:
        self._turns = _Rotation()

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        return self.pick_among(_candidates(pool, exclude))

    def pick_among(self, candidates: list[Server]) -> Server | None:
        """The pick among ``candidates`` (ready servers not excluded); None when it is empty."""
        if not candidates:
            return None
        low = min(s.in_flight for s in candidates)
        return self._turns.next([s for s in candidates if s.in_flight == low])


class PowerOfTwoRouter:
    """Two random candidates, the less loaded wins (ties: the first drawn). ``seed`` for tests."""

    needs_tokens = False
    holds_blocks = staticmethod(_no_blocks)

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        candidates = _candidates(pool, exclude)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        a, b = self._rng.sample(candidates, 2)
        return b if b.in_flight < a.in_flight else a


class SessionAffinityRouter:
    """Keeps a session on the server it last used (see the module docstring); ``inner`` picks the
    rest. Sessions are remembered in a bounded LRU (:data:`MAX_TRACKED_SESSIONS`)."""

    def __init__(self, inner: Router, balance_threshold: int = 4) -> None:
        self.inner = inner
        self.needs_tokens = inner.needs_tokens
        self.balance_threshold = balance_threshold
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def holds_blocks(self, pool: Pool) -> bool:
        return self.inner.holds_blocks(pool)

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        session = hint.session if hint is not None else None
        if session is None:
            return self.inner.pick(pool, exclude, hint)
        candidates = _candidates(pool, exclude)
        url = self._sessions.get(session)
        home = next((s for s in candidates if s.url == url), None) if url else None
        if home is not None and home.in_flight - min(s.in_flight for s in candidates) <= self.balance_threshold:
            self._sessions.move_to_end(session)
            return home
        best = self.inner.pick(pool, exclude, hint)
        if best is not None:
            self._sessions[session] = best.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > MAX_TRACKED_SESSIONS:
                self._sessions.popitem(last=False)
        return best


class KVCacheAwareRouter:
    """Scores servers by the prefix blocks they actually hold against their load (module docstring).

    ``indexes`` holds what each server's KV events say it holds (:mod:`orchestrator.kv_index`); a
    server without a synced index scores on load only (match 0) until it resynchronizes.
    """

    needs_tokens = True

    def __init__(self, indexes: KVIndexes, balance_threshold: int = 4, min_match_ratio: float = 0.5) -> None:
        self.indexes = indexes
        self.balance_threshold = balance_threshold
        self.min_match_ratio = min_match_ratio
        self._fallback = LeastLoadedRouter()

    def holds_blocks(self, pool: Pool) -> bool:
        for s in pool.servers:
            if s.state is ServerState.READY:
                index = self.indexes.find(s.url)
                if index is not None and index.synced and index.hashes:
                    return True
        return False

    def pick(self, pool: Pool, exclude: set[str], hint: RouteHint | None = None) -> Server | None:
        candidates = _candidates(pool, exclude)
        if not candidates:
            return None
        if hint is None or not hint.block_hashes or not self.holds_blocks(pool):
            return self._fallback.pick_among(candidates)  # (nothing held: every match would be 0)
        low = min(s.in_flight for s in candidates)
        scored = [(self.indexes.matched_blocks(s.url, hint.block_hashes) or 0, -s.in_flight, s) for s in candidates]
        match, neg_load, best = max(scored, key=lambda t: (t[0], t[1]))
        # A short shared head (a chat template, a one-line system prompt) is not worth affinity:
        # below min_match_ratio of the prompt's blocks, load decides.
        if (match == 0 or match < self.min_match_ratio * len(hint.block_hashes)
                or -neg_load - low > self.balance_threshold):
            return self._fallback.pick_among(candidates)
        return best

    def predicted_hit_blocks(self, pool: Pool, hint: RouteHint) -> int:
        """The longest prefix of ``hint.block_hashes`` (blocks) a ready server of ``pool`` holds by its
        KV events (servers without a synced index count 0): the orchestrator's estimate of a
        prefix-cache hit there (conditional disaggregation decides on the uncached rest)."""
        return max((self.indexes.matched_blocks(s.url, hint.block_hashes) or 0 for s in pool.ready()), default=0)


def make_router(name: str, balance_threshold: int = 4, session_affinity: bool = False,
                indexes: KVIndexes | None = None) -> Router:
    """The router called ``name`` (wrapped in :class:`SessionAffinityRouter` when
    ``session_affinity``); ``kv_cache_aware`` reads ``indexes`` (a fresh, empty one when None).
    Raises ValueError for an unknown name."""
    if name == "round_robin":
        router: Router = RoundRobinRouter()
    elif name == "least_loaded":
        router = LeastLoadedRouter()
    elif name == "power_of_two":
        router = PowerOfTwoRouter()
    elif name == "kv_cache_aware":
        router = KVCacheAwareRouter(indexes if indexes is not None else KVIndexes(), balance_threshold)
    else:
        raise ValueError(f"unknown router {name!r} (round_robin, least_loaded, power_of_two, kv_cache_aware)")
    return SessionAffinityRouter(router, balance_threshold) if session_affinity else router


def make_routers(topology: Topology, indexes: KVIndexes | None = None) -> dict[str, Router]:
    """One router per pool, as ``pools.<role>.router`` (default ``orchestrator.router``) says;
    ``kv_cache_aware`` ones share ``indexes`` (the KV event feeds fill it)."""
    s = topology.orchestrator
    affinity = s.session_affinity != "none"
    return {role: make_router(topology.pool_router(role), s.kv_aware_balance_threshold, affinity, indexes)
            for role in ("ctx", "gen")}
