"""Prefix cache under a seeded random workload (review of issue 10): requests sharing prefixes of
random lengths (block boundaries included), salts, a KV cache small enough to evict and preempt, a
token budget that chunks prefills, random ``reset_prefix_cache`` calls and aborts. After every step
the block manager's books must match the block tables (reference counts, free / evictable / in use)
and every block a running request will still write must be its own and uncached (a shared block is
never written); every answer must equal the one computed alone with caching off."""
import random
from collections import Counter

from engine.request import EngineRequest, Phase

from engine_testutil import greedy, run_all

BS = 4


def _check_books(engine) -> None:
    bm, sch = engine.block_manager, engine.scheduler
    tables = [s.block_ids for s in sch.running] + [s.block_ids for s in sch.connector.loading.values()]
    tables += list(sch.connector.parked.values())
    refs = Counter(b for t in tables for b in t if b >= 0)
    assert all(not s.block_ids for s in sch.waiting), "a waiting request holds blocks"
    free, evictable = set(bm._free), set(bm._evictable)
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == refs[b], f"block {b}: ref {bm.ref_count(b)}, in {refs[b]} tables"
        cached = bm._hash[b] is not None
        if refs[b]:
            assert b not in free and b not in evictable, f"block {b} in use and listed free"
        else:
            assert (b in free) != (b in evictable) and (b in evictable) == cached, f"block {b} lost"
    for seq in sch.running:  # blocks at or past num_computed are written by this request only
        for b in seq.block_ids[seq.num_computed // BS:]:
            assert bm.ref_count(b) == 1 and bm._hash[b] is None, f"{seq.request_id} would write shared block {b}"


def _workload(rng: random.Random, n: int) -> list[EngineRequest]:
    bases = [[rng.randrange(3, 5000) for _ in range(20)] for _ in range(3)]
    reqs = []
    for i in range(n):
        cut = rng.choice([0, 4, 8, 12, 16, 20, rng.randrange(1, 20)])
        tail = [rng.randrange(3, 5000) for _ in range(rng.choice([0, 0, 1, 3, 4, 8]))]
        prompt = rng.choice(bases)[:cut] + tail or [7]
        reqs.append(EngineRequest(f"r{i}", prompt, greedy(rng.randrange(1, 14)),
                                  cache_salt=rng.choice([None, None, "a", "b"])))
    return reqs


def test_random_workload_keeps_the_books_and_the_answers(tiny_engine_factory):
    rng = random.Random(0)
    eng = tiny_engine_factory(num_kv_blocks=20, block_size=BS, max_batch_size=5, max_num_tokens=13)
    off = tiny_engine_factory(num_kv_blocks=64, block_size=BS, enable_prefix_caching=False, kv_connector="none")
    reqs = _workload(rng, 30)
    ref = {rid: r["tokens"] for rid, r in
           run_all(off, [EngineRequest(r.request_id, r.prompt_token_ids, r.sampling) for r in reqs]).items()}
    got, aborted, pending, preempts = {r.request_id: [] for r in reqs}, set(), list(reqs), []
    preempt = eng.scheduler.preempt
    eng.scheduler.preempt = lambda seq: (preempts.append(seq.request_id), preempt(seq))
    for _ in range(5000):
        if not (pending or eng.has_work()):
            break
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                eng.add_request(pending.pop(0))
        if rng.random() < 0.03:
            eng.reset_prefix_cache()
        if rng.random() < 0.02 and eng.scheduler.running:
            aborted.add(rid := rng.choice(eng.scheduler.running).request_id)
            eng.abort_request(rid)
        for o in eng.step().outputs:
            got[o.request_id] += o.new_token_ids
        _check_books(eng)
    assert not pending and not eng.has_work() and eng.num_free_blocks == 20
    assert preempts and eng.stats()["prefix_cache_hits"] > 0, "the workload should preempt and hit"
    assert {rid: t for rid, t in got.items() if rid not in aborted} == \
        {rid: t for rid, t in ref.items() if rid not in aborted}


def test_multi_turn_partial_pulls_with_evicting_caches(tiny_engine_factory):
    """Conversations ctx -> gen sharing a system prefix (parked blocks shared on the ctx side), a gen
    cache that evicts between turns and random gen resets: each pull names exactly the ctx lease
    blocks past the ones the gen cache still holds, and every answer equals the colocated one."""
    rng = random.Random(3)
    ctx = tiny_engine_factory(num_kv_blocks=100, block_size=BS, max_num_tokens=24)
    gen = tiny_engine_factory(num_kv_blocks=48, block_size=BS, max_batch_size=4)
    off = tiny_engine_factory(num_kv_blocks=64, block_size=BS, enable_prefix_caching=False, kv_connector="none")
    system = [rng.randrange(3, 5000) for _ in range(9)]
    history = [system + [rng.randrange(3, 5000) for _ in range(rng.randrange(0, 6))] for _ in range(4)]
    reused = 0
    for turn in range(3):
        live = {}
        for c, prompt in enumerate(history):
            n, rid = rng.randrange(2, 9), f"c{c}t{turn}"
            (out,) = run_all_parked(ctx, EngineRequest("x" + rid, prompt, greedy(n), phase=Phase.CONTEXT_ONLY))
            gen.add_request(EngineRequest(rid, prompt, greedy(n), phase=Phase.GENERATION_ONLY,
                                          first_token_ids=out.new_token_ids, source_block_hashes=ctx.hasher.hashes(prompt)))
            live[rid] = (c, prompt, n, out, [])
        if rng.random() < 0.3:
            gen.reset_prefix_cache()
        for _ in range(2000):
            if not gen.has_work():
                break
            step = gen.step()
            for pull in step.kv_pulls:
                c, prompt, n, out, _ = live[pull.request_id]
                src = out.parked_block_ids[pull.first_block:]
                assert len(src) == len(pull.block_ids) and pull.first_block <= len(prompt) // BS
                if src:
                    gen.kv_cache[pull.block_ids] = ctx.kv_cache[src]
                reused += pull.first_block
                gen.kv_ready(pull.request_id, ok=True)
                assert ctx.release_parked(out.request_id)
            for o in step.outputs:
                live[o.request_id][4].extend(o.new_token_ids)
            _check_books(gen)
        for rid, (c, prompt, n, _, tokens) in live.items():
            assert tokens == run_all(off, [EngineRequest(rid, prompt, greedy(n))])[rid]["tokens"], rid
            history[c] = prompt + tokens + [rng.randrange(3, 5000) for _ in range(rng.randrange(1, 9))]
    assert reused > 0 and gen.num_free_blocks == 48 and ctx.num_free_blocks == 100


def run_all_parked(engine, req: EngineRequest) -> list:
    """Run one context_only request to its hand-off; its blocks stay parked."""
    engine.add_request(req)
    outs = []
    for _ in range(2000):
        if not engine.has_work():
            break
        outs += engine.step().outputs
    _check_books(engine)
    return outs
