"""Router policies beside the control-plane ones: power of two choices and session affinity."""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator.pools import Pool, Server, ServerState
from orchestrator.router import (PowerOfTwoRouter, RoundRobinRouter, RouteHint, SessionAffinityRouter,
                                 make_router)


def pool_of(*loads: int) -> Pool:
    servers = [Server("gen", i, f"http://s{i}", state=ServerState.READY) for i in range(len(loads))]
    for s, load in zip(servers, loads):
        s.in_flight = load
    return Pool("gen", servers)


def test_power_of_two_never_picks_the_busiest_and_favours_the_idle():
    p, r = pool_of(0, 5, 10), PowerOfTwoRouter(seed=1)
    picks = Counter(r.pick(p, set()).url for _ in range(600))
    # pairs {0,5}→s0, {0,10}→s0, {5,10}→s1: s0 two times in three, s1 one in three, s2 never
    assert picks["http://s2"] == 0
    assert 350 < picks["http://s0"] < 450 and 150 < picks["http://s1"] < 250


def test_power_of_two_respects_exclude_and_small_pools():
    p, r = pool_of(0, 5, 10), PowerOfTwoRouter(seed=2)
    assert {r.pick(p, {"http://s0"}).url for _ in range(50)} == {"http://s1"}
    assert r.pick(p, {"http://s0", "http://s1"}).url == "http://s2"
    assert r.pick(p, {"http://s0", "http://s1", "http://s2"}) is None
    p.servers[0].start_draining()
    assert "http://s0" not in {r.pick(p, set()).url for _ in range(50)}


def test_session_affinity_sticks_until_the_home_is_busy_or_gone():
    p = pool_of(0, 0, 0)
    r = SessionAffinityRouter(RoundRobinRouter(), balance_threshold=2)
    a = RouteHint(session="a")
    home = r.pick(p, set(), a)
    assert all(r.pick(p, set(), a) is home for _ in range(5))
    assert len({r.pick(p, set()).url for _ in range(3)}) == 3  # no session: the inner policy
    home.in_flight = 3  # 3 more than the least loaded: too busy, the session moves
    moved = r.pick(p, set(), a)
    assert moved is not home and r.pick(p, set(), a) is moved
    moved.mark_unhealthy("gone")
    assert r.pick(p, set(), a) not in (moved, None)
    assert r.pick(p, {s.url for s in p.servers}, a) is None


def test_make_router_names_and_wrapping():
    assert isinstance(make_router("power_of_two"), PowerOfTwoRouter)
    wrapped = make_router("kv_cache_aware", session_affinity=True)
    assert isinstance(wrapped, SessionAffinityRouter) and wrapped.needs_tokens
    with pytest.raises(ValueError, match="power_of_two"):
        make_router("random")
