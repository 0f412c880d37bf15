"""Drain by moving KV, engine level: a request moved off one engine at a decode step boundary
(``LLMEngine.move_out``) and continued on another that pulls its blocks equals the undisturbed run,
and the target computes exactly one token before it samples on (no recompute of the moved context)."""
import pytest

from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams
from engine.errors import RequestValidationError

from engine_testutil import greedy, run_all

BS = 16
N = 40


@pytest.fixture(scope="module")
def engines(tiny_engine_factory):
    """(source, target, reference) engines, shared by this module's tests (building one costs seconds);
    each test starts them with empty prefix caches."""
    made = tuple(tiny_engine_factory(num_kv_blocks=64, block_size=BS) for _ in range(3))
    yield made


@pytest.fixture
def fresh(engines):
    for eng in engines:
        assert not eng.has_work() and eng.num_free_blocks == eng.config.num_kv_blocks
        eng.reset_prefix_cache()
    return engines


def _prompt(n, start=300):
    return [start + (i * 7) % 997 for i in range(n)]


def _seeded(n):
    return SamplingParams(max_tokens=n, temperature=0.9, seed=1234, ignore_eos=True)


def _run_until(engine, rid, k):
    """Step ``engine`` until request ``rid`` has produced ``k`` output tokens; return them."""
    tokens = []
    for _ in range(10_000):
        if len(tokens) >= k:
            return tokens
        for o in engine.step().outputs:
            assert o.request_id == rid and not o.finished
            tokens += o.new_token_ids
    raise AssertionError("no progress")


def _move(src, rid):
    """move_out on ``src``; the next step reports the request moved with its parked blocks."""
    assert src.move_out() == [rid]
    (out,) = src.step().outputs
    assert out.finished and out.finish_reason == "moved" and out.new_token_ids == []
    assert out.moved is not None and out.parked_block_ids is not None
    return out


def _continue(dst, src, out, params, rid="t"):
    """A generation_only request on ``dst`` that pulls exactly the blocks its KVPull names from the
    moved request's parked blocks (as the gen worker side does); returns (new tokens, pull, computed
    in the first step after the KV landed)."""
    moved = out.moved
    prompt = moved.token_ids[:moved.num_prompt_tokens]
    first = moved.token_ids[moved.num_prompt_tokens:]
    dst.add_request(EngineRequest(rid, prompt, params, phase=Phase.GENERATION_ONLY, first_token_ids=first,
                                  kv_num_tokens=moved.kv_num_tokens, source_block_hashes=moved.block_hashes,
                                  choice_index=moved.choice_index or 0))  # a moved choice samples as itself
    (pull,) = dst.step().kv_pulls
    src_blocks = out.parked_block_ids[pull.first_block:pull.first_block + len(pull.block_ids)]
    assert len(src_blocks) == len(pull.block_ids)
    if src_blocks:
        dst.kv_cache[pull.block_ids] = src.kv_cache[src_blocks]
    dst.kv_ready(rid, ok=True)
    computed0 = dst.stats()["tokens_computed"]
    step = dst.step()
    first_step = dst.stats()["tokens_computed"] - computed0
    tokens = [t for o in step.outputs for t in o.new_token_ids]
    while dst.has_work():
        tokens += [t for o in dst.step().outputs for t in o.new_token_ids]
    return tokens, pull, first_step


@pytest.mark.parametrize("k,sampling", [(1, "greedy"), (7, "greedy"), (24, "greedy"), (25, "greedy"),
                                        (7, "seeded")])  # k outputs before the move; 24/25: KV ends on / past a block edge
def test_moved_request_equals_undisturbed_and_computes_one_token(fresh, k, sampling):
    src, dst, ref = fresh
    params = greedy(N) if sampling == "greedy" else _seeded(N)
    prompt = _prompt(25)
    undisturbed = run_all(ref, [EngineRequest("u", prompt, params)])["u"]["tokens"]
    src.add_request(EngineRequest("m", prompt, params, movable=True))
    before = _run_until(src, "m", k)
    assert len(before) == k and before == undisturbed[:k]
    out = _move(src, "m")
    kv_tokens = len(prompt) + k - 1  # the last sampled token has no KV yet
    assert out.moved.token_ids == prompt + before and out.moved.kv_num_tokens == kv_tokens
    assert len(out.parked_block_ids) >= -(-kv_tokens // BS)
    assert len(out.moved.block_hashes) == kv_tokens // BS
    computed_before, loaded_before = dst.stats()["tokens_computed"], dst.stats()["kv_blocks_loaded"]
    after, pull, first_step = _continue(dst, src, out, params)
    assert before + after[k:] == undisturbed and after[:k] == before  # first_gen_tokens are re-emitted once
    # No recompute: the pull brings every KV block (nothing cached on dst), the target computes the
    # one token left (the last moved output) and then one per new token.
    assert pull.num_tokens == kv_tokens and pull.first_block == 0
    assert len(pull.block_ids) == -(-kv_tokens // BS)
    assert first_step == 1
    assert dst.stats()["tokens_computed"] - computed_before == N - k
    assert dst.stats()["kv_blocks_loaded"] - loaded_before == len(pull.block_ids)
    assert src.release_parked("m") and src.num_free_blocks == src.config.num_kv_blocks
    assert dst.num_free_blocks == dst.config.num_kv_blocks


def test_partial_pull_of_a_moved_request(fresh):
    """The target already holds the prompt's full blocks in its prefix cache: it pulls only the rest."""
    src, dst, _ = fresh
    prompt = _prompt(40)
    undisturbed = run_all(dst, [EngineRequest("u", prompt, greedy(N))])["u"]["tokens"]  # caches 2 prompt blocks
    src.add_request(EngineRequest("m", prompt, greedy(N), movable=True))
    before = _run_until(src, "m", 12)
    out = _move(src, "m")
    after, pull, first_step = _continue(dst, src, out, greedy(N))
    assert before + after[12:] == undisturbed
    assert pull.first_block >= 2 and first_step == 1  # 51 KV tokens: dst caches at least the prompt's 2 full blocks
    assert len(pull.block_ids) == -(-(40 + 11) // BS) - pull.first_block
    assert src.release_parked("m")


def test_only_movable_requests_in_decode_move(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=64, block_size=BS, max_num_tokens=8)
    eng.add_request(EngineRequest("fixed", _prompt(5), greedy(N)))                 # not movable
    eng.add_request(EngineRequest("long", _prompt(30, 500), greedy(N), movable=True))  # prefilling in chunks of 8
    eng.step()
    assert eng.move_out() == []  # "long" is still prefilling, "fixed" may not move
    for _ in range(6):
        eng.step()
    assert eng.move_out() == ["long"]
    moved = [o for o in eng.step().outputs if o.finish_reason == "moved"]
    assert [o.request_id for o in moved] == ["long"]
    assert eng.stats()["requests_moved_out"] == 1
    eng.abort_request("long")  # an abort of a moved request frees its parked blocks
    while eng.has_work():
        eng.step()
    assert eng.num_free_blocks == eng.config.num_kv_blocks


def test_kv_num_tokens_is_checked(fresh):
    eng = fresh[0]
    with pytest.raises(RequestValidationError, match="kv_num_tokens"):
        eng.add_request(EngineRequest("x", _prompt(5), greedy(4), phase=Phase.GENERATION_ONLY,
                                      first_token_ids=[1, 2], kv_num_tokens=7))  # at most 5 + 2 - 1
    with pytest.raises(RequestValidationError, match="kv_num_tokens"):
        eng.add_request(EngineRequest("y", _prompt(5), greedy(4), kv_num_tokens=5))
