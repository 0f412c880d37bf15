"""Lazily hashed prompt blocks: the same names as pdserve.block_hash, hashed only as far as read."""

from __future__ import annotations

import random

import pytest

from orchestrator.kv_index import KVIndexes
from orchestrator.pools import Pool, Server, ServerState
from orchestrator.prompt_blocks import PromptBlocks, prompt_blocks
from orchestrator.router import KVCacheAwareRouter, RouteHint
from pdserve.block_hash import BlockHasher
from pdserve.kv_events import KVSnapshot

BS = 4


@pytest.mark.parametrize("n, salt", [(0, None), (3, None), (4, None), (37, None), (64, "tenant-a")])
def test_the_hashes_are_the_servers_block_names(n, salt):
    ids = [random.Random(n).randrange(2**31) for _ in range(n)]
    eager = BlockHasher("m", "float32", BS).hashes(ids, salt)
    lazy = prompt_blocks(ids, BS, "m", "float32", salt)
    assert len(lazy) == len(eager) == n // BS
    assert list(lazy) == eager                       # by iteration
    assert [lazy[i] for i in range(len(lazy))] == eager and lazy[-1:] == eager[-1:]
    assert lazy.hashed == len(eager)


def test_length_costs_nothing_and_reads_hash_only_what_they_reach():
    ids = list(range(4000))
    blocks = prompt_blocks(ids, BS, "m", "float32")
    assert len(blocks) == 1000 and blocks.hashed == 0
    assert blocks[2] == BlockHasher("m", "float32", BS).hashes(ids[:12])[2] and blocks.hashed == 3
    with pytest.raises(IndexError):
        blocks[1000]


def test_a_router_walk_stops_one_block_past_the_longest_held_prefix():
    ids = list(range(4000))
    held = BlockHasher("m", "float32", BS).hashes(ids[:40])  # 10 blocks on s0, nothing on s1
    indexes = KVIndexes()
    servers = [Server("ctx", i, f"http://s{i}", state=ServerState.READY) for i in range(2)]
    indexes.get("http://s0").load_snapshot(KVSnapshot("e", 0, tuple(held)))
    indexes.get("http://s1").load_snapshot(KVSnapshot("e", 0, ()))
    router = KVCacheAwareRouter(indexes, min_match_ratio=0.0)
    blocks = prompt_blocks(ids, BS, "m", "float32")
    assert router.pick(Pool("ctx", servers), set(), RouteHint(blocks, len(ids))).url == "http://s0"
    assert blocks.hashed == 11  # the 10 held + the first miss, not 1,000
    assert router.predicted_hit_blocks(Pool("ctx", servers), RouteHint(blocks, len(ids))) == 10


def test_bad_token_ids_and_block_sizes_are_refused():
    with pytest.raises(ValueError, match="2\\*\\*32"):
        PromptBlocks([2**32, 1, 2, 3], BS, b"r" * 16)[0]
    with pytest.raises(ValueError):
        prompt_blocks([1, 2], 0, "m", "float32")
