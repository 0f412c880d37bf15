"""kv_cache_aware does not tokenize a prompt when no server's KV index holds a block (no pick can
depend on the blocks then; the hit self-check takes the prompt's length from the ctx answer's
usage), tokenizes it before the pick otherwise, and before any later pick whose pool holds a
block by then; the picks and the hit self-check come out the same either way."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from orchestrator import disagg
from orchestrator.disagg import DisaggFlow, Exchange
from orchestrator.kv_index import KVIndexes
from orchestrator.kv_selfcheck import HitSelfCheck
from orchestrator.metrics import Metrics
from orchestrator.pools import ClusterPools, Pool, Server, ServerState
from orchestrator.router import KVCacheAwareRouter, block_hashes
from pdserve.config import OrchestratorSettings
from pdserve.kv_events import KVSnapshot

BS = 4
IDS = list(range(100, 124))  # 6 full blocks
FINAL = {"id": "c", "object": "text_completion", "created": 1, "model": "m", "usage": {"prompt_tokens": 24},
         "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                      "disaggregated_params": {"cached_tokens": 0}}]}


class Tokenizer:
    """A stand-in :class:`orchestrator.prompt_tokens.PromptTokenizer` that logs when it runs."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def inline(self, body: dict) -> bool:
        return True

    def token_ids_now(self, endpoint: str, body: dict) -> list[int]:
        self.log.append("tokenize")
        return IDS

    async def token_ids(self, endpoint: str, body: dict) -> list[int]:
        return self.token_ids_now(endpoint, body)


@pytest.fixture
def setup(monkeypatch):
    log: list[str] = []

    async def start_post(client, server, path, body, request_id=None, auth=()):
        log.append(f"write {server.url}")
        return contextlib.nullcontext()

    async def read_answer(pending, deadline, phase, timeout_s):
        log.append("read")
        return json.dumps(FINAL).encode()

    monkeypatch.setattr(disagg, "start_post", start_post)
    monkeypatch.setattr(disagg, "read_answer", read_answer)
    servers = {r: [Server(r, i, f"http://{r}{i}", state=ServerState.READY) for i in range(2)] for r in ("ctx", "gen")}
    pools = ClusterPools(Pool("ctx", servers["ctx"]), Pool("gen", servers["gen"]))
    indexes, metrics = KVIndexes(), Metrics()
    for s in pools.all_servers():
        indexes.get(s.url).load_snapshot(KVSnapshot("e", 0, ()))
    routers = {r: KVCacheAwareRouter(indexes) for r in ("ctx", "gen")}
    check = HitSelfCheck(indexes, BS, metrics.registry)
    flow = DisaggFlow(pools, routers, None, OrchestratorSettings(), metrics, None, Tokenizer(log), BS, "m",
                      "float32", check)
    return flow, indexes, check, log


def run(flow: DisaggFlow) -> Exchange:
    ex = Exchange("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 4})
    asyncio.run(flow.handle(ex))
    return ex


def test_no_block_held_anywhere_never_tokenizes(setup):
    flow, _, check, log = setup
    ex = run(flow)
    assert log == ["write http://ctx0", "read"]
    assert ex.hint is not None and ex.hint.pending is not None  # still pending: never needed
    hits = check.pools["ctx"]  # the length is the ctx server's usage.prompt_tokens
    assert (hits.requests, hits.prompt_tokens, hits.predicted_hit_tokens, hits.unindexed) == (1, 24, 0, 0)


def test_an_answer_without_prompt_tokens_tokenizes_after_it_for_the_self_check(setup, monkeypatch):
    flow, _, check, log = setup
    no_usage = {k: v for k, v in FINAL.items() if k != "usage"}

    async def read_answer(pending, deadline, phase, timeout_s):
        log.append("read")
        return json.dumps(no_usage).encode()

    monkeypatch.setattr(disagg, "read_answer", read_answer)
    run(flow)
    assert log == ["write http://ctx0", "read", "tokenize"]
    hits = check.pools["ctx"]
    assert (hits.requests, hits.prompt_tokens, hits.predicted_hit_tokens, hits.unindexed) == (1, 24, 0, 0)


def test_an_unsynced_index_predicts_nothing_either_way(setup):
    flow, indexes, check, log = setup
    indexes.get("http://ctx0").drop("stream broke")
    run(flow)
    assert log == ["write http://ctx0", "read"] and check.pools["ctx"].unindexed == 1


def test_a_later_pick_tokenizes_once_its_pool_holds_a_block(setup):
    """A pending hint (nothing held at the ctx pick) meets a gen pool where gen1 now holds the
    prompt's first 4 of 6 blocks: the gen pick tokenizes first and goes there; a gen pool that
    still holds nothing picks without tokenizing."""
    flow, indexes, _, log = setup
    ex = Exchange("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 4})

    async def attempt(server):
        return server.url

    async def gen_pick():
        return await flow._with_retries("gen", attempt, ex.hint)

    ex.hint = asyncio.run(flow._route_hint(ex))
    assert ex.hint is not None and ex.hint.pending is not None and log == []
    asyncio.run(gen_pick())
    assert log == [] and ex.hint.pending is not None  # nothing held: load decides, no tokens needed
    indexes.get("http://gen1").load_snapshot(KVSnapshot("e", 1, block_hashes(IDS, BS, "m", "float32")[:4]))
    _, url = asyncio.run(gen_pick())
    assert log == ["tokenize"] and url == "http://gen1" and ex.hint.pending is None
    assert ex.hint.num_tokens == 24 and len(ex.hint.block_hashes) == 6


def test_a_held_block_tokenizes_first_and_routes_on_it(setup):
    flow, indexes, check, log = setup
    indexes.get("http://ctx1").load_snapshot(KVSnapshot("e", 0, block_hashes(IDS, BS, "m", "float32")[:4]))
    run(flow)
    assert log == ["tokenize", "write http://ctx1", "read"]  # 4 of 6 blocks held there: affinity
    assert check.pools["ctx"].predicted_hit_tokens == 16
