"""Prefix caching in the engine: greedy output identical with caching on and off, hits reported,
shared blocks never written, eviction under memory pressure never serves stale KV."""
import pytest
import torch

from engine.request import EngineRequest, Phase

from engine_testutil import greedy, run_all

BS = 4


@pytest.fixture(scope="module")
def engines(tiny_engine_factory):
    """(caching on, caching off), block size 4: many block boundaries in short prompts."""
    return (tiny_engine_factory(num_kv_blocks=128, block_size=BS),
            tiny_engine_factory(num_kv_blocks=128, block_size=BS, enable_prefix_caching=False))


def _tokens(n, start=3):
    return [start + (7 * i) % 900 for i in range(n)]


def _one(engine, rid, prompt, n=12, **kw):
    res = run_all(engine, [EngineRequest(rid, prompt, greedy(n), **kw)])[rid]
    return res["tokens"], res["outputs"][-1].num_cached_tokens


@pytest.mark.parametrize("plen", [3 * BS, 3 * BS + 1, 3 * BS - 1, 1, BS])
def test_repeat_hits_cache_and_equals_uncached(engines, plen):
    on, off = engines
    on.reset_prefix_cache()
    prompt = _tokens(plen, start=11 + plen)
    reference, cached_off = _one(off, "ref", prompt)
    first, cached_first = _one(on, "a", prompt)
    second, cached_second = _one(on, "b", prompt)
    assert first == second == reference
    assert cached_off == 0 and cached_first == 0
    # At most plen - 1 tokens come from the cache: ending on a block boundary reuses all but the last block.
    assert cached_second == ((plen - 1) // BS) * BS


def test_prefix_shared_then_diverging(engines):
    on, off = engines
    on.reset_prefix_cache()
    shared = _tokens(10)
    prompts = [shared + _tokens(5, start=500 + 13 * i) for i in range(3)]
    for i, p in enumerate(prompts):
        tokens, cached = _one(on, f"d{i}", p)
        assert tokens == _one(off, f"r{i}", p)[0]
        assert cached == (0 if i == 0 else 8)   # two full shared blocks; block 2 holds divergent tokens


def test_concurrent_requests_sharing_a_prefix(engines):
    on, off = engines
    on.reset_prefix_cache()
    shared = _tokens(13, start=40)
    prompts = [shared + _tokens(3 + i, start=700 + i) for i in range(6)]
    cold = run_all(on, [EngineRequest(f"k{i}", p, greedy(16)) for i, p in enumerate(prompts)])  # same step
    assert [o["outputs"][-1].num_cached_tokens for o in cold.values()] == [0] * 6
    on.reset_prefix_cache()
    warm = _one(on, "warm", shared)[0]
    res_on = run_all(on, [EngineRequest(f"c{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    res_off = run_all(off, [EngineRequest(f"c{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    assert warm == _one(off, "w", shared)[0]
    for i in range(len(prompts)):
        assert res_on[f"c{i}"]["tokens"] == res_off[f"c{i}"]["tokens"] == cold[f"k{i}"]["tokens"]
        assert res_on[f"c{i}"]["outputs"][-1].num_cached_tokens == 12


def test_shared_blocks_are_never_written(engines):
    on, _ = engines
    on.reset_prefix_cache()
    prompt = _tokens(4 * BS)                       # ends exactly on a block boundary
    _one(on, "w", prompt)
    hit = on.block_manager.match_prefix(on.hasher.hashes(prompt), prompt)
    assert len(hit) == 4
    before = on.kv_cache[hit].clone()
    on.add_request(EngineRequest("x", prompt, greedy(8)))
    on.add_request(EngineRequest("y", prompt + [5, 6], greedy(8)))
    while on.has_work():
        on.step()
    assert torch.equal(on.kv_cache[hit], before)


def test_decoded_blocks_are_cached(engines):
    on, off = engines
    on.reset_prefix_cache()
    prompt = _tokens(6, start=90)
    out, _ = _one(on, "t1", prompt, n=10)          # 16 tokens; the last one's KV is never computed
    turn2 = prompt + out + [17, 18, 19]
    tokens, cached = _one(on, "t2", turn2)
    assert cached == 3 * BS                         # blocks 0-2: 6 prompt + 6 decoded tokens
    assert tokens == _one(off, "t2", turn2)[0]


def test_chunked_prefill_after_a_hit(tiny_engine_factory, engines):
    _, off = engines
    eng = tiny_engine_factory(num_kv_blocks=64, block_size=BS, max_num_tokens=6)
    prompt = _tokens(30, start=300)
    assert _one(eng, "a", prompt)[0] == _one(off, "ref", prompt)[0]
    longer = prompt + _tokens(17, start=800)
    tokens, cached = _one(eng, "b", longer)
    assert cached == 28 and tokens == _one(off, "ref2", longer)[0]


def test_different_salts_never_share(engines):
    on, off = engines
    on.reset_prefix_cache()
    prompt = _tokens(12, start=60)
    assert _one(on, "s1", prompt, cache_salt="tenant-a")[1] == 0
    assert _one(on, "s2", prompt, cache_salt="tenant-b")[1] == 0
    assert _one(on, "s3", prompt)[1] == 0
    tokens, cached = _one(on, "s4", prompt, cache_salt="tenant-a")
    assert cached == 8 and tokens == _one(off, "ref", prompt)[0]


def test_eviction_under_memory_pressure(tiny_engine_factory, engines):
    _, off = engines
    eng = tiny_engine_factory(num_kv_blocks=16, block_size=BS, max_batch_size=4)
    prompts = [_tokens(9, start=100 * i + 1) for i in range(8)]   # 8 x 5 blocks with outputs >> 16
    refs = [_one(off, f"r{i}", p, n=8)[0] for i, p in enumerate(prompts)]
    evicted = []
    forget = eng.block_manager._forget
    eng.block_manager._forget = lambda b: (evicted.append(b), forget(b))
    for rnd in range(2):
        res = run_all(eng, [EngineRequest(f"e{rnd}-{i}", p, greedy(8)) for i, p in enumerate(prompts)])
        assert [res[f"e{rnd}-{i}"]["tokens"] for i in range(8)] == refs
    assert len(evicted) > 16, "cached blocks had to be evicted and their ids reused"
    # The prompt that ran last is still cached; the first one's blocks were reused (no stale hit).
    assert _one(eng, "late", prompts[-1], n=8) == (refs[-1], 8)
    assert _one(eng, "early", prompts[0], n=8)[0] == refs[0]


def test_preemption_rehits_the_cache(tiny_engine_factory, engines):
    _, off = engines
    eng = tiny_engine_factory(num_kv_blocks=14, block_size=BS, max_batch_size=6)
    preempts = []
    orig = eng.scheduler.preempt
    eng.scheduler.preempt = lambda seq: (preempts.append(seq.request_id), orig(seq))
    lookups = []
    reuse = eng.scheduler._reuse_prefix
    eng.scheduler._reuse_prefix = lambda seq, hit: (lookups.append((seq.request_id, len(hit))), reuse(seq, hit))
    shared = _tokens(8, start=5)
    prompts = [shared + [900 + i] for i in range(6)]
    res = run_all(eng, [EngineRequest(f"p{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    assert preempts, "the small cache should force preemption"
    readmitted = [hit for rid in set(preempts) for hit in [h for r, h in lookups if r == rid][1:]]
    assert readmitted and max(readmitted) >= 2   # a recompute after preemption re-hit the cache
    for i, p in enumerate(prompts):
        assert res[f"p{i}"]["tokens"] == _one(off, f"r{i}", p, n=16)[0]
    assert eng.stats()["prefix_cache_hits"] > 0


def test_counters_and_reset(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=32, block_size=BS)
    prompt = _tokens(10, start=33)
    _one(eng, "a", prompt)
    _one(eng, "b", prompt)
    s = eng.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (20, 8)
    assert s["cached_blocks"] == 5 and s["free_blocks"] == 32        # cached blocks count as free
    assert eng.reset_prefix_cache() == 5
    assert eng.stats()["cached_blocks"] == 0 and _one(eng, "c", prompt)[1] == 0


def test_disaggregated_with_cache_on_both_sides(tiny_engine_factory, engines):
    _, off = engines
    ctx = tiny_engine_factory(num_kv_blocks=64, block_size=BS)
    gen = tiny_engine_factory(num_kv_blocks=64, block_size=BS)
    prompt = _tokens(11, start=250)
    reference = _one(off, "ref", prompt)[0]
    for rnd, expect_cached in ((0, 0), (1, 8)):
        ctx.add_request(EngineRequest(f"c{rnd}", prompt, greedy(12), phase=Phase.CONTEXT_ONLY))
        outs = []
        while ctx.has_work():
            outs += ctx.step().outputs
        (out,) = outs
        assert out.num_cached_tokens == expect_cached and out.new_token_ids == reference[:1]
        gen.add_request(EngineRequest(f"g{rnd}", prompt, greedy(12), phase=Phase.GENERATION_ONLY,
                                      first_token_ids=out.new_token_ids, num_cached_tokens=out.num_cached_tokens))
        pull = gen.step().kv_pulls[0]
        # Round 0 left 5 full blocks (prompt + decoded) in the gen cache; a pull still writes only
        # fresh blocks (partial pulls are not built), never the cached ones.
        assert gen.stats()["cached_blocks"] == (0 if rnd == 0 else 5)
        hits = gen.block_manager.match_prefix(gen.hasher.hashes(prompt), prompt)
        assert len(hits) == 2 * rnd and not set(pull.block_ids) & set(hits)
        gen.kv_cache[pull.block_ids[:3]] = ctx.kv_cache[out.parked_block_ids]
        gen.kv_ready(f"g{rnd}", ok=True)
        assert gen.stats()["cached_blocks"] == (2 if rnd == 0 else 5)   # the pulled full blocks joined
        tokens, last = [], None
        while gen.has_work():
            for o in gen.step().outputs:
                tokens += o.new_token_ids
                last = o
        assert tokens == reference and last.num_cached_tokens == expect_cached
        assert ctx.release_parked(f"c{rnd}")
    assert ctx.num_free_blocks == 64 and gen.num_free_blocks == 64


def test_failed_pull_caches_nothing(tiny_engine_factory):
    gen = tiny_engine_factory(num_kv_blocks=16, block_size=BS)
    prompt = _tokens(9, start=77)
    gen.add_request(EngineRequest("g", prompt, greedy(4), phase=Phase.GENERATION_ONLY, first_token_ids=[5]))
    assert gen.step().kv_pulls
    gen.kv_ready("g", ok=False)
    gen.step()
    assert gen.stats()["cached_blocks"] == 0 and gen.num_free_blocks == 16
    assert _one(gen, "c", prompt)[1] == 0
