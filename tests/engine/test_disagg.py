"""CONTEXT_ONLY on one engine + GENERATION_ONLY on another == colocated (greedy)."""
import pytest

from engine.request import EngineRequest, Phase

from engine_testutil import greedy, run_all


def _ctx(engine, rid, prompt, n):
    engine.add_request(EngineRequest(rid, prompt, greedy(n), phase=Phase.CONTEXT_ONLY))
    outs = []
    while engine.has_work():
        outs += engine.step().outputs
    assert len(outs) == 1
    return outs[0]


def _gen(engine, src, rid, prompt, first, parked, n, later=False):
    """``later``: generation_first, the first tokens come with kv_ready (admitted before the ctx sampled)."""
    engine.add_request(EngineRequest(rid, prompt, greedy(n), phase=Phase.GENERATION_ONLY,
                                     first_token_ids=None if later else first, first_tokens_later=later))
    step = engine.step()
    assert step.outputs == [] and len(step.kv_pulls) == 1
    pull = step.kv_pulls[0]
    assert pull.num_tokens == len(prompt) and len(pull.block_ids) == len(parked)
    for _ in range(3):   # not scheduled until the KV is there
        assert engine.step().outputs == []
    engine.kv_cache[pull.block_ids] = src.kv_cache[parked]
    if later:
        engine.kv_ready(rid, ok=True, first_token_ids=first, num_cached_tokens=0)
    else:
        engine.kv_ready(rid, ok=True)
    tokens, outs = [], []
    while engine.has_work():
        for o in engine.step().outputs:
            tokens += o.new_token_ids
            outs.append(o)
    assert outs[0].new_token_ids[0] == first[0]
    return tokens, outs


def _prompt_of_len(tok, n):
    ids = tok.encode(" ".join(f"word{i}" for i in range(n)))
    return ids[:n]


@pytest.mark.parametrize("later", [False, True], ids=["context_first", "generation_first"])
@pytest.mark.parametrize("plen", [1, 5, 16, 17, 50])
def test_split_equals_colocated(tiny_engine_factory, tiny_engine, plen, later):
    ctx_eng, gen_eng = tiny_engine, tiny_engine_factory(num_kv_blocks=64)
    prompt = _prompt_of_len(tiny_engine.tokenizer, plen)
    assert len(prompt) == plen
    n = 12
    colocated = run_all(ctx_eng, [EngineRequest("co", prompt, greedy(n))])["co"]["tokens"]
    out = _ctx(ctx_eng, "x", prompt, n)
    assert out.finished and out.finish_reason is None and out.new_token_ids == colocated[:1]
    assert out.num_output_tokens == 1 and len(out.parked_block_ids) == -(-plen // 16)
    free_before = ctx_eng.num_free_blocks
    tokens, outs = _gen(gen_eng, ctx_eng, "x", prompt, out.new_token_ids,
                        out.parked_block_ids, n, later)
    assert tokens == colocated
    assert outs[-1].num_output_tokens == n and outs[-1].finish_reason == "length"
    assert ctx_eng.release_parked("x") and not ctx_eng.release_parked("x")
    assert ctx_eng.num_free_blocks == free_before + len(out.parked_block_ids)
    assert gen_eng.num_free_blocks == gen_eng.config.num_kv_blocks


def test_split_smollm2_same_engine(smollm2_engine):
    eng = smollm2_engine
    prompt = eng.tokenizer.encode("The history of Rome begins with " * 8)
    colocated = run_all(eng, [EngineRequest("co", prompt, greedy(16))])["co"]["tokens"]
    out = _ctx(eng, "ctx", prompt, 16)
    tokens, _ = _gen(eng, eng, "gen", prompt, out.new_token_ids, out.parked_block_ids, 16)
    assert tokens == colocated
    assert eng.release_parked("ctx")
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_context_only_finishing_first_token_frees_blocks(tiny_engine):
    out = _ctx(tiny_engine, "one", [5, 6, 7], 1)
    assert out.finish_reason == "length" and out.parked_block_ids is None
    assert tiny_engine.num_free_blocks == tiny_engine.config.num_kv_blocks


def test_gen_only_first_token_can_finish(tiny_engine):
    eng = tiny_engine
    eng.add_request(EngineRequest("g1", [5, 6, 7], greedy(1), phase=Phase.GENERATION_ONLY,
                                  first_token_ids=[9]))
    pull = eng.step().kv_pulls[0]
    eng.kv_ready("g1", ok=True)
    outs = eng.step().outputs
    assert [(o.new_token_ids, o.finish_reason, o.num_output_tokens) for o in outs] == \
        [([9], "length", 1)]
    assert pull.block_ids and eng.num_free_blocks == eng.config.num_kv_blocks


def test_first_tokens_later_needs_them_absent_and_can_finish_at_kv_ready(tiny_engine):
    eng = tiny_engine
    with pytest.raises(ValueError, match="first_tokens_later"):
        eng.add_request(EngineRequest("g0", [5, 6, 7], greedy(1), phase=Phase.GENERATION_ONLY,
                                      first_token_ids=[9], first_tokens_later=True))
    eng.add_request(EngineRequest("g1", [5, 6, 7], greedy(1), phase=Phase.GENERATION_ONLY, first_tokens_later=True))
    pull = eng.step().kv_pulls[0]
    assert pull.block_ids  # allocated before anyone knows the first token
    eng.kv_ready("g1", ok=True, first_token_ids=[9], num_cached_tokens=2)
    outs = eng.step().outputs
    assert [(o.new_token_ids, o.finish_reason, o.num_cached_tokens) for o in outs] == [([9], "length", 2)]
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_failed_pull_and_aborts(tiny_engine):
    eng = tiny_engine
    eng.add_request(EngineRequest("g2", [5, 6, 7], greedy(4), phase=Phase.GENERATION_ONLY,
                                  first_token_ids=[9]))
    assert eng.step().kv_pulls
    eng.kv_ready("g2", ok=False)
    outs = eng.step().outputs
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("g2", True, "abort")]
    # abort while waiting for KV, and of a parked context
    eng.add_request(EngineRequest("g3", [5, 6, 7], greedy(4), phase=Phase.GENERATION_ONLY,
                                  first_token_ids=[9]))
    eng.step()
    eng.abort_request("g3")
    assert [o.finish_reason for o in eng.step().outputs] == ["abort"]
    out = _ctx(eng, "c3", [5, 6, 7], 4)
    assert out.parked_block_ids
    eng.abort_request("c3")
    assert not eng.has_work() and eng.step().outputs == []
    assert eng.num_free_blocks == eng.config.num_kv_blocks
    eng.abort_request("unknown")
