"""n > 1 in the engine: one prefill, n decodes sharing the prompt's blocks (engine.choices)."""
import pytest

from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams
from engine.errors import RequestValidationError

from engine_testutil import greedy, run_all


def sampled(max_tokens: int = 12, seed: int = 7, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def run_choices(engine, reqs, max_steps=10_000):
    """Add reqs, step until idle; (request_id, index) -> tokens, plus every output in order."""
    for r in reqs:
        engine.add_request(r)
    tokens, outs = {}, []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            outs.append(o)
    assert not engine.has_work(), "engine did not finish"
    return tokens, outs


def choices_of(tokens, rid, n):
    return [tokens[(rid, i)] for i in range(n)]


def _prompt(engine, n):
    return engine.tokenizer.encode(" ".join(f"word{i}" for i in range(n)))[:n]


def assert_one_final(outs, rid):
    mine = [o for o in outs if o.request_id == rid]
    assert [o.finished for o in mine].count(True) == 1 and mine[-1].finished


@pytest.mark.parametrize("plen", [5, 16, 21])
def test_greedy_choices_equal_n1_and_free_every_block(tiny_engine, plen):
    eng = tiny_engine
    prompt = _prompt(eng, plen)
    one = run_all(eng, [EngineRequest("one", prompt, greedy(10))])["one"]["tokens"]
    tokens, outs = run_choices(eng, [EngineRequest("three", prompt, greedy(10), n=3)])
    assert choices_of(tokens, "three", 3) == [one] * 3
    assert_one_final(outs, "three")
    finals = {o.index: o for o in outs if o.finish_reason is not None}
    assert sorted(finals) == [0, 1, 2]
    assert all(o.finish_reason == "length" and o.num_output_tokens == 10 for o in finals.values())
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_seeded_choices_reproducible_distinct_and_choice0_is_n1(tiny_engine):
    eng = tiny_engine
    prompt = _prompt(eng, 21)
    a, _ = run_choices(eng, [EngineRequest("a", prompt, sampled(), n=4)])
    b, _ = run_choices(eng, [EngineRequest("b", prompt, sampled(), n=4)])
    one = run_all(eng, [EngineRequest("one", prompt, sampled())])["one"]["tokens"]
    assert choices_of(a, "a", 4) == choices_of(b, "b", 4)
    assert len({tuple(t) for t in choices_of(a, "a", 4)}) == 4
    assert a[("a", 0)] == one
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_one_prefill_then_n_decodes(tiny_engine):
    """The forward passes see the prompt once and each choice's own tokens after it."""
    eng, seen = tiny_engine, []
    forward = eng.runner.forward

    def counting(plan, compute_logits=True):
        seen.append(len(plan.input_ids))
        return forward(plan, compute_logits)

    eng.runner.forward = counting
    try:
        eng.reset_prefix_cache()
        prompt = _prompt(eng, 37)
        run_choices(eng, [EngineRequest("p", prompt, greedy(6), n=3)])
    finally:
        eng.runner.forward = forward
    assert sum(seen) == 37 + 3 * (6 - 1)
    assert seen[0] == 37


def test_choices_share_full_blocks_and_copy_the_partial_one(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=32)
    prompt = _prompt(eng, 37)   # 2 full blocks of 16 + 5 tokens
    eng.add_request(EngineRequest("f", prompt, greedy(4), n=3))
    eng.step()                   # prefill + fork
    family = eng.families.members("f")
    assert [s.index for s in family] == [0, 1, 2]
    tables = [s.block_ids for s in family]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert all(eng.block_manager.ref_count(b) == 3 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 3   # each choice its own copy of the partial block
    while eng.has_work():
        eng.step()
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_prefix_cache_on_off_same_choices(tiny_engine_factory):
    on, off = (tiny_engine_factory(num_kv_blocks=64, enable_prefix_caching=c) for c in (True, False))
    prompt = _prompt(on, 40)
    want, _ = run_choices(off, [EngineRequest("r", prompt, sampled(20), n=3)])
    for rid in ("warm", "hot"):  # the second run starts from the cached prompt blocks
        got, _ = run_choices(on, [EngineRequest(rid, prompt, sampled(20), n=3)])
        assert choices_of(got, rid, 3) == choices_of(want, "r", 3)
    assert on.stats()["prefix_cache_hits"] >= 32


def test_no_block_for_the_copy_recomputes_that_choice(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=3)
    prompt = _prompt(eng, 21)   # 2 blocks; the fork finds 1 free block for 2 copies
    one = run_all(eng, [EngineRequest("one", prompt, greedy(4))])["one"]["tokens"]
    tokens, outs = run_choices(eng, [EngineRequest("t", prompt, greedy(4), n=3)])
    assert choices_of(tokens, "t", 3) == [one] * 3
    assert_one_final(outs, "t")
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_abort_a_forked_request(tiny_engine):
    eng = tiny_engine
    eng.add_request(EngineRequest("ab", _prompt(eng, 21), greedy(50), n=3))
    eng.step()
    eng.step()
    eng.abort_request("ab")
    outs = eng.step().outputs
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.finish_reason == "abort" for o in outs) and [o.finished for o in outs].count(True) == 1
    assert not eng.has_work() and eng.num_free_blocks == eng.config.num_kv_blocks


def _ctx_choices(engine, rid, prompt, params, n):
    tokens, outs = run_choices(engine, [EngineRequest(rid, prompt, params, phase=Phase.CONTEXT_ONLY, n=n)])
    assert len(outs) == n and sorted(o.index for o in outs) == list(range(n))
    return [tokens[(rid, i)][0] for i in range(n)], outs[-1]


@pytest.mark.parametrize("params", [sampled, greedy])  # greedy: a wrong KV copy shows (sampled noise can hide it)
@pytest.mark.parametrize("plen", [16, 21])
def test_disaggregated_choices_equal_colocated(tiny_engine_factory, tiny_engine, plen, params):
    ctx_eng, gen_eng = tiny_engine, tiny_engine_factory(num_kv_blocks=64)
    gen_eng.kv_cache.normal_()  # blocks hold stale KV, as reused blocks do: a block not copied shows
    prompt = _prompt(ctx_eng, plen)
    colocated, _ = run_choices(ctx_eng, [EngineRequest("co", prompt, params(), n=3)])
    first, last = _ctx_choices(ctx_eng, "x", prompt, params(), 3)
    assert last.finished and last.parked_block_ids and len(last.parked_block_ids) == -(-plen // 16)
    assert first == [colocated[("co", i)][0] for i in range(3)]
    gen_eng.add_request(EngineRequest("x", prompt, params(), phase=Phase.GENERATION_ONLY, first_token_ids=first, n=3))
    pull = gen_eng.step().kv_pulls[0]
    gen_eng.kv_cache[pull.block_ids] = ctx_eng.kv_cache[last.parked_block_ids]
    gen_eng.kv_ready("x", ok=True)
    tokens, outs = run_choices(gen_eng, [])
    assert choices_of(tokens, "x", 3) == choices_of(colocated, "co", 3)
    assert_one_final(outs, "x")
    assert ctx_eng.release_parked("x")
    assert ctx_eng.num_free_blocks == ctx_eng.config.num_kv_blocks
    assert gen_eng.num_free_blocks == gen_eng.config.num_kv_blocks


def test_ctx_choices_all_finished_at_first_token_park_nothing(tiny_engine):
    first, last = _ctx_choices(tiny_engine, "done", [5, 6, 7], greedy(1), 2)
    assert last.parked_block_ids is None and last.finish_reason == "length"
    assert tiny_engine.num_free_blocks == tiny_engine.config.num_kv_blocks


def test_validation_of_n(tiny_engine):
    eng = tiny_engine
    with pytest.raises(RequestValidationError, match="n must be"):
        eng.add_request(EngineRequest("v0", [5, 6], greedy(2), n=0))
    with pytest.raises(RequestValidationError, match="one first token per choice"):
        eng.add_request(EngineRequest("v1", [5, 6], greedy(2), phase=Phase.GENERATION_ONLY, first_token_ids=[9], n=2))
    with pytest.raises(RequestValidationError, match="generation_first"):
        eng.add_request(EngineRequest("v2", [5, 6], greedy(2), phase=Phase.GENERATION_ONLY, first_tokens_later=True,
                                      n=2))


def test_an_n1_request_with_choice_index_samples_what_that_choice_samples(tiny_engine_factory, tiny_engine):
    """A continuation of choice i (a migrated choice: n = 1, choice_index i, the choice's tokens so
    far as first tokens, the prompt prefilled again on a ctx engine) draws exactly what choice i of
    the undisturbed n > 1 request draws; so does a colocated n = 1 request with choice_index i."""
    ctx_eng, gen_eng = tiny_engine, tiny_engine_factory(num_kv_blocks=64)
    prompt = _prompt(ctx_eng, 21)
    tokens, _ = run_choices(ctx_eng, [EngineRequest("three", prompt, sampled(), n=3)])
    assert len({tuple(tokens[("three", i)]) for i in range(3)}) == 3  # the choices differ: the index matters
    for i in range(3):
        want = tokens[("three", i)]
        got, outs = run_choices(ctx_eng, [EngineRequest(f"c{i}", prompt, sampled(), choice_index=i)])
        assert got[(f"c{i}", i)] == want and {o.index for o in outs} == {i}
        _, last = _ctx_choices(ctx_eng, f"g{i}", prompt, sampled(), 1)
        gen_eng.add_request(EngineRequest(f"g{i}", prompt, sampled(), phase=Phase.GENERATION_ONLY,
                                          first_token_ids=want[:5], choice_index=i))
        pull = gen_eng.step().kv_pulls[0]
        gen_eng.kv_cache[pull.block_ids] = ctx_eng.kv_cache[last.parked_block_ids]
        gen_eng.kv_ready(f"g{i}", ok=True)
        got, outs = run_choices(gen_eng, [])
        assert got[(f"g{i}", i)] == want and {o.index for o in outs} == {i}, i
        assert ctx_eng.release_parked(f"g{i}")
    assert gen_eng.num_free_blocks == gen_eng.config.num_kv_blocks


def test_validation_of_choice_index(tiny_engine):
    with pytest.raises(RequestValidationError, match="choice_index"):
        tiny_engine.add_request(EngineRequest("ci0", [5, 6], greedy(2), n=2, choice_index=1))
    with pytest.raises(RequestValidationError, match="choice_index"):
        tiny_engine.add_request(EngineRequest("ci1", [5, 6], greedy(2), choice_index=16))
