"""The KV connector's scheduler side (engine.kv_connector): partial pulls by block hash, and an
engine without a connector."""
import pytest

from engine.request import EngineRequest, Phase
from engine.errors import RequestValidationError

from engine_testutil import greedy, run_all

BS = 16


def _tokens(n, start=300):
    return [start + (i * 7) % 997 for i in range(n)]


def _ctx_turn(ctx, rid, prompt, n):
    ctx.add_request(EngineRequest(rid, prompt, greedy(n), phase=Phase.CONTEXT_ONLY))
    outs = []
    while ctx.has_work():
        outs += ctx.step().outputs
    (out,) = outs
    return out


def _gen_turn(gen, ctx, rid, prompt, out, n, hashes=True):
    """Run one generation_only request on ``gen`` with the ctx answer ``out``; copy exactly the
    blocks the pull names (as the worker side would) and return (tokens, the pull)."""
    names = ctx.hasher.hashes(prompt) if hashes else None
    gen.add_request(EngineRequest(rid, prompt, greedy(n), phase=Phase.GENERATION_ONLY,
                                  first_token_ids=out.new_token_ids, source_block_hashes=names))
    step = gen.step()
    (pull,) = step.kv_pulls
    src = out.parked_block_ids[pull.first_block:pull.first_block + len(pull.block_ids)]
    assert len(src) == len(pull.block_ids)
    if src:
        gen.kv_cache[pull.block_ids] = ctx.kv_cache[src]
    gen.kv_ready(rid, ok=True)
    tokens = []
    while gen.has_work():
        for o in gen.step().outputs:
            tokens += o.new_token_ids
    assert ctx.release_parked(out.request_id)
    return tokens, pull


@pytest.mark.parametrize("extra", [21, 12])  # turn 2 ends mid-block / exactly on a block boundary
def test_turn_two_pulls_only_the_blocks_the_gen_cache_lacks(tiny_engine_factory, extra):
    ctx, gen = (tiny_engine_factory(num_kv_blocks=64, block_size=BS) for _ in range(2))
    full_gen = tiny_engine_factory(num_kv_blocks=64, block_size=BS, enable_prefix_caching=False)
    colocated = tiny_engine_factory(num_kv_blocks=64, block_size=BS, kv_connector="none")
    n = 12
    turn1 = _tokens(40)
    out1 = _ctx_turn(ctx, "c1", turn1, n)
    answer1, pull1 = _gen_turn(gen, ctx, "g1", turn1, out1, n)
    assert pull1.first_block == 0 and len(pull1.block_ids) == 3  # nothing cached yet: all 3 blocks
    # Turn 2: the whole history (40 prompt + 12 answer tokens: 3 full blocks decoded on gen) + more.
    turn2 = turn1 + answer1 + _tokens(extra, start=500)
    out2 = _ctx_turn(ctx, "c2", turn2, n)
    loaded, reused = gen.stats()["kv_blocks_loaded"], gen.stats()["kv_blocks_reused"]
    answer2, pull2 = _gen_turn(gen, ctx, "g2", turn2, out2, n)
    prompt_blocks = -(-len(turn2) // BS)
    assert pull2.first_block == 3 and len(pull2.block_ids) == prompt_blocks - 3
    assert gen.stats()["kv_blocks_loaded"] - loaded == prompt_blocks - 3
    assert gen.stats()["kv_blocks_reused"] - reused == 3
    # Oracles: the same tokens as a full pull into an engine without a cache, and as colocated.
    out2b = _ctx_turn(ctx, "c2b", turn2, n)
    answer_full, pull_full = _gen_turn(full_gen, ctx, "f2", turn2, out2b, n)
    assert pull_full.first_block == 0 and len(pull_full.block_ids) == prompt_blocks
    expected = run_all(colocated, [EngineRequest("co", turn2, greedy(n))])["co"]["tokens"]
    assert answer2 == answer_full == expected
    for eng in (ctx, gen, full_gen):
        assert eng.num_free_blocks == 64 and not eng.has_work()


def test_every_prompt_block_cached_pulls_nothing(tiny_engine_factory):
    """A prompt of whole blocks the gen cache holds entirely: the pull names no block (the worker
    side only releases the lease) and decoding is still correct."""
    ctx, gen = (tiny_engine_factory(num_kv_blocks=32, block_size=BS) for _ in range(2))
    colocated = tiny_engine_factory(num_kv_blocks=32, block_size=BS, kv_connector="none")
    prompt = _tokens(32, start=90)
    first, _ = _gen_turn(gen, ctx, "g1", prompt, _ctx_turn(ctx, "c1", prompt, 6), 6)
    tokens, pull = _gen_turn(gen, ctx, "g2", prompt, _ctx_turn(ctx, "c2", prompt, 6), 6)
    assert pull.first_block == 2 and pull.block_ids == []
    assert tokens == first == run_all(colocated, [EngineRequest("co", prompt, greedy(6))])["co"]["tokens"]


def test_hashes_of_other_tokens_are_not_reused(tiny_engine_factory):
    """The sender's hashes name blocks the gen cache holds, but for other tokens: a hit compares
    token ids, so nothing is reused and the whole prompt is pulled."""
    ctx, gen = (tiny_engine_factory(num_kv_blocks=32, block_size=BS) for _ in range(2))
    cached = _tokens(32, start=90)
    _gen_turn(gen, ctx, "g1", cached, _ctx_turn(ctx, "c1", cached, 4), 4)
    other = _tokens(32, start=91)
    out = _ctx_turn(ctx, "c2", other, 4)
    gen.add_request(EngineRequest("g2", other, greedy(4), phase=Phase.GENERATION_ONLY,
                                  first_token_ids=out.new_token_ids, source_block_hashes=ctx.hasher.hashes(cached)))
    (pull,) = gen.step().kv_pulls
    assert pull.first_block == 0 and len(pull.block_ids) == 2
    gen.kv_ready("g2", ok=False)
    gen.step()
    assert ctx.release_parked("c2") and gen.num_free_blocks == 32


def test_an_engine_without_a_connector_runs_colocated_only(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=16, kv_connector="none")
    assert eng.scheduler.connector is None
    for phase in (Phase.CONTEXT_ONLY, Phase.GENERATION_ONLY):
        with pytest.raises(RequestValidationError, match="no KV connector"):
            first = [4] if phase is Phase.GENERATION_ONLY else None
            eng.add_request(EngineRequest("x", [1, 2, 3], greedy(2), phase=phase, first_token_ids=first))
    assert run_all(eng, [EngineRequest("co", [1, 2, 3], greedy(3))])["co"]["tokens"]
    assert eng.stats()["parked_requests"] == 0 and eng.stats()["pulling_requests"] == 0
