"""Conditional disaggregation decides on the uncached prompt length where the gen router knows it."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.disagg import DisaggFlow
from orchestrator.pools import Pool, Server, ServerState
from orchestrator.router import KVCacheAwareRouter, RoundRobinRouter, RouteHint, SessionAffinityRouter, block_hashes
from pdserve.config import OrchestratorSettings

BS = 4


def flow(gen_router) -> tuple[DisaggFlow, Pool]:
    gen = Pool("gen", [Server("gen", i, f"http://g{i}", state=ServerState.READY) for i in range(2)])
    settings = OrchestratorSettings(max_local_prefill_length=16)
    return DisaggFlow(SimpleNamespace(gen=gen), {"gen": gen_router}, None, settings, None, None, block_size=BS), gen


def hint(ids: list[int]) -> RouteHint:
    return RouteHint(block_hashes(ids, BS, "m", "float32"), len(ids))


def test_a_long_prompt_whose_prefix_a_gen_server_holds_is_short():
    router = KVCacheAwareRouter()
    f, gen = flow(router)
    turn1 = list(range(100, 140))                  # 40 tokens: long
    assert not f._is_short(hint(turn1))
    router.pick(gen, set(), hint(turn1))           # the gen phase of turn 1 went to one gen server
    turn2 = turn1 + list(range(7, 17))             # 50 tokens, 40 of them (10 blocks) held there
    assert f._predicted_gen_hit_tokens(hint(turn2)) == 40
    assert f._is_short(hint(turn2))                # 10 uncached < 16
    assert not f._is_short(hint(turn2 + list(range(20, 30))))  # 20 uncached
    assert not f._is_short(hint(list(range(500, 540))))        # nothing cached


def test_without_a_cache_record_the_whole_prompt_counts():
    for router in (RoundRobinRouter(), SessionAffinityRouter(RoundRobinRouter())):
        f, gen = flow(router)
        ids = list(range(100, 140))
        router.pick(gen, set(), hint(ids))
        assert f._predicted_gen_hit_tokens(hint(ids + [1, 2])) == 0 and not f._is_short(hint(ids + [1, 2]))
    f, gen = flow(SessionAffinityRouter(KVCacheAwareRouter()))
    f._routers["gen"].pick(gen, set(), hint(list(range(100, 140))))
    assert f._is_short(hint(list(range(100, 140)) + [1, 2]))  # the wrapped policy's record is used
