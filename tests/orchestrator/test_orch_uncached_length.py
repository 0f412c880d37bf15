"""Conditional disaggregation decides on the uncached prompt length where the gen router knows it
(kv_cache_aware: the blocks each gen server's KV events say it holds)."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.disagg import DisaggFlow
from orchestrator.kv_index import KVIndexes
from orchestrator.pools import Pool, Server, ServerState
from orchestrator.router import KVCacheAwareRouter, RoundRobinRouter, RouteHint, SessionAffinityRouter, block_hashes
from pdserve.config import OrchestratorSettings
from pdserve.kv_events import KVSnapshot

BS = 4


def flow(gen_router) -> tuple[DisaggFlow, Pool]:
    gen = Pool("gen", [Server("gen", i, f"http://g{i}", state=ServerState.READY) for i in range(2)])
    settings = OrchestratorSettings(max_local_prefill_length=16)
    return DisaggFlow(SimpleNamespace(gen=gen), {"gen": gen_router}, None, settings, None, None, block_size=BS), gen


def hint(ids: list[int]) -> RouteHint:
    return RouteHint(block_hashes(ids, BS, "m", "float32"), len(ids))


def holding(indexes: KVIndexes, url: str, ids: list[int]) -> None:
    indexes.get(url).load_snapshot(KVSnapshot("e", 0, hint(ids).block_hashes))


def test_a_long_prompt_whose_prefix_a_gen_server_holds_is_short():
    indexes = KVIndexes()
    f, gen = flow(KVCacheAwareRouter(indexes))
    turn1 = list(range(100, 140))                  # 40 tokens: long
    assert not f._is_short(hint(turn1))
    holding(indexes, "http://g1", turn1)           # turn 1 was decoded on g1: its 10 blocks are cached
    turn2 = turn1 + list(range(7, 17))             # 50 tokens, 40 of them held on g1
    assert f._predicted_gen_hit_tokens(hint(turn2)) == 40
    assert f._is_short(hint(turn2))                # 10 uncached < 16
    assert not f._is_short(hint(turn2 + list(range(20, 30))))  # 20 uncached
    assert not f._is_short(hint(list(range(500, 540))))        # nothing cached
    assert f._predicted_gen_hit_tokens(hint(turn1)) == 39      # at most prompt - 1, as the cache
    gen.servers[1].start_draining()
    assert not f._is_short(hint(turn2))            # only ready servers count


def test_without_a_cache_record_the_whole_prompt_counts():
    ids = list(range(100, 140))
    for router in (RoundRobinRouter(), SessionAffinityRouter(RoundRobinRouter())):
        f, gen = flow(router)
        router.pick(gen, set(), hint(ids))
        assert f._predicted_gen_hit_tokens(hint(ids + [1, 2])) == 0 and not f._is_short(hint(ids + [1, 2]))
    indexes = KVIndexes()
    f, _ = flow(SessionAffinityRouter(KVCacheAwareRouter(indexes)))
    holding(indexes, "http://g0", ids)
    assert f._is_short(hint(ids + [1, 2]))         # the wrapped policy's index is used
    indexes.get("http://g0").drop("stream broke")
    assert not f._is_short(hint(ids + [1, 2]))     # an unsynced index is never trusted
