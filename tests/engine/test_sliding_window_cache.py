"""Prefix-cache reuse under a sliding window: a hit needs only the blocks the window reaches from
the resume point, so it survives the eviction of the prompt's first blocks (which come back as
NULL_BLOCK); CONTEXT_ONLY hand-offs keep the full-attention rule (their whole table moves)."""
import pytest

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.block_manager import NULL_BLOCK, BlockManager

from engine_testutil import cpu_settings, greedy, run_all
from families import WINDOW, hf_reference, prompts
from test_disagg import _ctx

BS = 4


def _cached_chain(bm: BlockManager, n: int, skip=()) -> tuple[list[bytes], list[int], list[int]]:
    """Blocks 0..n-1 of a fake chain, cached except the indices in skip: (hashes, tokens, ids)."""
    hashes = [bytes([i]) * 16 for i in range(n)]
    tokens = list(range(100, 100 + n * BS))
    ids = bm.allocate(n)
    for i in range(n):
        if i not in skip:
            assert bm.cache_block(ids[i], hashes[i], tokens[i * BS:(i + 1) * BS])
    bm.deallocate(ids)
    return hashes, tokens, ids


@pytest.mark.parametrize("window,skipped", [(6, 3), (9, 3), (10, 2), (13, 2), (14, None)])
def test_window_hit_needs_only_the_blocks_the_window_reaches(window, skipped):
    bm = BlockManager(num_blocks=16, block_size=BS)
    hashes, tokens, ids = _cached_chain(bm, 5, skip={0, 1})
    assert bm.match_prefix(hashes, tokens) == []            # full attention: block 0 is gone
    # resuming at 5 * 4 = 20, queries read keys from 20 - window + 1 on
    hit = bm.match_prefix(hashes, tokens, window=window)
    if (20 - window + 1) // BS < 2:                          # the window reaches a missing block
        assert hit == []
    else:
        assert hit == [NULL_BLOCK] * skipped + ids[skipped:5]


def test_window_hit_stops_before_a_missing_block_the_window_needs():
    bm = BlockManager(num_blocks=16, block_size=BS)
    hashes, tokens, ids = _cached_chain(bm, 5, skip={3})
    assert bm.match_prefix(hashes, tokens) == ids[:3]
    assert bm.match_prefix(hashes, tokens, window=6) == [NULL_BLOCK] + ids[1:3]
    tokens[4 * BS] += 1                                      # block 4's tokens differ: no match
    assert bm.match_prefix(hashes, tokens, window=2) == [NULL_BLOCK] * 2 + ids[2:3]


def test_null_entries_are_skipped_by_share_and_deallocate():
    bm = BlockManager(num_blocks=8, block_size=BS)
    hashes, tokens, ids = _cached_chain(bm, 4, skip={0})
    match = bm.match_prefix(hashes, tokens, window=5)
    assert match == [NULL_BLOCK] * 3 + ids[3:]
    # sharing takes block ids[3] out of the 8 unreferenced ones; the NULL entries take none
    assert bm.can_allocate(7, sharing=match) and not bm.can_allocate(8, sharing=match)
    hit = bm.share(match)
    assert bm.ref_count(ids[3]) == 1 and bm.num_free_blocks == 7
    bm.deallocate(hit)
    assert bm.num_free_blocks == 8 and bm.ref_count(ids[3]) == 0


def _evict_first_blocks(engine: LLMEngine, prompt: list[int], n: int) -> None:
    """Evict the first n cached blocks of prompt, keep the others (through the manager's verbs:
    the later blocks are re-referenced so they become most recently used)."""
    bm = engine.block_manager
    chain = engine.hasher.chain(None)
    ids = bm.match_prefix(chain.extend(prompt), prompt)
    assert len(ids) == len(prompt) // BS
    bm.deallocate(bm.share(ids[n:]))
    free = bm.num_free_blocks - bm.num_cached_blocks          # never-cached blocks go first
    bm.deallocate(bm.allocate(free + n))
    assert bm.match_prefix(chain.extend(prompt), prompt) == []
    assert bm.num_cached_blocks == len(ids) - n


@pytest.fixture
def mistral_engine(family_dirs):
    return LLMEngine(cpu_settings(num_kv_blocks=64, block_size=BS), str(family_dirs["mistral"]))


def _resume_after_eviction(eng: LLMEngine) -> tuple[list[int], dict]:
    """Cache a 40-token prompt, evict its first 3 blocks, run it + 8 tokens; (prompt, result)."""
    first = prompts(seed=3)[4][:40]
    run_all(eng, [EngineRequest("a", first, greedy(4))])
    _evict_first_blocks(eng, first, 3)
    longer = first + prompts(seed=4)[0][:8]
    return longer, run_all(eng, [EngineRequest("b", longer, greedy(16))])["b"]


def test_engine_resumes_after_window_hit_and_matches_hf(mistral_engine, family_dirs):
    assert mistral_engine.scheduler.sliding_window == WINDOW
    longer, res = _resume_after_eviction(mistral_engine)
    # resuming at 40 the window (12) reaches back to key 29, in block 7: blocks 7-9 suffice
    assert res["outputs"][-1].num_cached_tokens == 40
    assert res["tokens"] == hf_reference(family_dirs["mistral"], [longer], 16)[0]


def test_negative_control_a_hit_rule_narrower_than_the_window_fails_loudly(mistral_engine):
    # the scheduler believes in a 4-token window: it skips blocks 7 and 8, which the model's
    # 12-token window still reads; a NULL_BLOCK (-1) entry is an invalid gather index, so the
    # step fails instead of attending to some other block's KV
    mistral_engine.scheduler.sliding_window = 4
    with pytest.raises(IndexError):
        _resume_after_eviction(mistral_engine)


def test_context_only_hand_off_keeps_the_full_attention_rule(mistral_engine, family_dirs):
    eng = mistral_engine
    first = prompts(seed=5)[3][:40]
    run_all(eng, [EngineRequest("a", first, greedy(2))])
    _evict_first_blocks(eng, first, 3)
    longer = first + [7, 8, 9, 10, 11]
    reference = hf_reference(family_dirs["mistral"], [longer], 8)[0]
    out = _ctx(eng, "c", longer, 8)
    assert out.num_cached_tokens == 0 and NULL_BLOCK not in out.parked_block_ids
    assert out.new_token_ids == reference[:1]
    assert eng.release_parked("c")
    # the hand-off computed (and cached) the whole prompt: now a full hit, colocated
    again = run_all(eng, [EngineRequest("d", longer, greedy(8))])["d"]
    assert again["outputs"][-1].num_cached_tokens == 44 and again["tokens"] == reference


# ---- mixed windows (Gemma 3: sliding layers + global ones; Qwen3 with max_window_layers) --------
MIXED = ("gemma3", "qwen3_window")


def _mixed_engine(family_dirs, family, caching=True, **kw) -> LLMEngine:
    return LLMEngine(cpu_settings(num_kv_blocks=64, block_size=BS, enable_prefix_caching=caching, **kw),
                     str(family_dirs[family]))


def _turns(eng: LLMEngine, evict: int) -> tuple[list[int], dict]:
    """Turn 1 caches a 40-token prompt; ``evict`` of its first blocks are evicted; turn 2 (turn 1's
    prompt + 8 tokens) runs greedy: (turn 2's prompt, its result)."""
    first = prompts(seed=3)[4][:40]
    run_all(eng, [EngineRequest("a", first, greedy(4))])
    if evict:
        _evict_first_blocks(eng, first, evict)
    longer = first + prompts(seed=4)[0][:8]
    return longer, run_all(eng, [EngineRequest("b", longer, greedy(16))])["b"]


@pytest.mark.parametrize("family,budget", [("gemma3", None), ("gemma3", 7), ("qwen3_window", 7)],
                         ids=["gemma3-one_chunk", "gemma3-chunks_of_7", "qwen3_window-chunks_of_7"])
def test_mixed_windows_hit_equals_caching_off(family, budget, family_dirs):
    kw = {} if budget is None else {"max_num_tokens": budget}
    on = _mixed_engine(family_dirs, family, **kw)
    assert on.scheduler.sliding_window is None   # a full-attention layer reads every block
    longer, res = _turns(on, evict=0)
    assert res["outputs"][-1].num_cached_tokens == 40
    off = run_all(_mixed_engine(family_dirs, family, caching=False, **kw),
                  [EngineRequest("b", longer, greedy(16))])["b"]
    assert res["tokens"] == off["tokens"]


@pytest.mark.parametrize("family", MIXED)
def test_mixed_windows_need_every_block_of_the_prefix(family, family_dirs):
    # the sliding layers would resume after blocks 7-9, but the full layer reads blocks 0-2 too
    longer, res = _turns(_mixed_engine(family_dirs, family), evict=3)
    assert res["outputs"][-1].num_cached_tokens == 0
    assert res["tokens"] == hf_reference(family_dirs[family], [longer], 16)[0]


def test_negative_control_the_sliding_layers_rule_on_a_mixed_model_fails_loudly(family_dirs):
    # the rule of the sliding layers alone (W = 12) hands the full layer NULL_BLOCK entries for the
    # evicted blocks 0-2: an invalid gather index, so the step fails instead of reading other KV
    eng = _mixed_engine(family_dirs, "gemma3")
    eng.scheduler.sliding_window = WINDOW
    with pytest.raises(IndexError):
        _turns(eng, evict=3)


def test_mixed_windows_turn_two_pulls_only_new_blocks_and_equals_colocated(family_dirs):
    """A gen server's reuse under Gemma 3's windows: turn 2 shares the blocks turn 1 left in the gen
    cache and pulls the rest; the tokens equal a colocated engine without a cache."""
    from test_partial_pull import _ctx_turn, _gen_turn
    ctx, gen = _mixed_engine(family_dirs, "gemma3"), _mixed_engine(family_dirs, "gemma3")
    turn1 = prompts(seed=6)[2]                                       # 36 tokens: 9 blocks
    answer1, pull1 = _gen_turn(gen, ctx, "g1", turn1, _ctx_turn(ctx, "c1", turn1, 8), 8)
    assert pull1.first_block == 0 and len(pull1.block_ids) == 9
    turn2 = turn1 + answer1 + prompts(seed=7)[0][:6]                 # 50 tokens: 13 blocks
    answer2, pull2 = _gen_turn(gen, ctx, "g2", turn2, _ctx_turn(ctx, "c2", turn2, 8), 8)
    assert pull2.first_block == 10 and len(pull2.block_ids) == 3   # 36 + 7 decoded on gen: 10 full blocks
    off = LLMEngine(cpu_settings(num_kv_blocks=64, block_size=BS, enable_prefix_caching=False),
                    str(family_dirs["gemma3"]), kv_connector="none")
    assert answer2 == run_all(off, [EngineRequest("co", turn2, greedy(8))])["co"]["tokens"]
