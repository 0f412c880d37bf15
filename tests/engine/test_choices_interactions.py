"""n > 1 with the features beside it in the engine: each choice's own structured-output matcher
(colocated and ctx -> gen), and drain ``move_kv`` of n > 1 requests: each movable one's choices are
parked one by one and continued elsewhere (or handed back when one cannot be parked); a request not
movable is passed over."""
import json

import jsonschema
import pytest

from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams
from engine.errors import RequestValidationError
from pdserve.structured_output import StructuredOutputSpec

from engine_testutil import PROMPTS, greedy
from test_choices import choices_of, run_choices
from test_kv_move import _continue
from test_structured_output_engine import first_pull

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
JSON = StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA)


def json_params(seed: int = 11) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_output=JSON)


def _run(engine, reqs):
    """run_choices, but a new engine's first structured-output request first waits (off the step)
    for the grammar library's vocabulary view: step until it is admitted, then to the end."""
    return run_choices(engine, reqs, max_steps=100_000)


def test_each_choice_keeps_its_own_grammar_state(tiny_engine):
    """A shared matcher would consume every choice's tokens and refuse them ("abort")."""
    prompt = tiny_engine.tokenizer.encode(PROMPTS[3])
    one, _ = _run(tiny_engine, [EngineRequest("one", prompt, json_params())])
    tokens, outs = _run(tiny_engine, [EngineRequest("four", prompt, json_params(), n=4)])
    finals = {o.index: o.finish_reason for o in outs if o.finish_reason is not None}
    assert finals == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}
    texts = [tiny_engine.tokenizer.decode(t) for t in choices_of(tokens, "four", 4)]
    for text in texts:
        jsonschema.validate(json.loads(text.strip()), SCHEMA)
    assert len(set(texts)) > 1  # seeded choices differ
    assert tokens[("four", 0)] == one[("one", 0)]  # choice 0 of n == n = 1 (same seed)
    assert tiny_engine.num_free_blocks == tiny_engine.config.num_kv_blocks


def test_disaggregated_choices_with_a_grammar_equal_colocated(tiny_engine_factory, tiny_engine):
    """ctx samples the n first tokens under the one mask; on the gen engine each choice's matcher
    consumes only its own first token (not the n tokens in a row) and decodes on."""
    ctx, gen = tiny_engine, tiny_engine_factory(num_kv_blocks=64)
    prompt = tiny_engine.tokenizer.encode(PROMPTS[3])
    colo, _ = _run(ctx, [EngineRequest("co", prompt, json_params(), n=3)])
    t, outs = _run(ctx, [EngineRequest("x", prompt, json_params(), phase=Phase.CONTEXT_ONLY, n=3)])
    first = [t[("x", i)][0] for i in range(3)]
    assert first == [colo[("co", i)][0] for i in range(3)]
    parked = outs[-1].parked_block_ids
    gen.add_request(EngineRequest("x", prompt, json_params(), phase=Phase.GENERATION_ONLY, first_token_ids=first, n=3))
    pull = first_pull(gen)
    gen.kv_cache[pull.block_ids] = ctx.kv_cache[parked]
    gen.kv_ready("x", ok=True)
    tokens, gen_outs = run_choices(gen, [])
    assert choices_of(tokens, "x", 3) == choices_of(colo, "co", 3)
    assert {o.finish_reason for o in gen_outs if o.finish_reason is not None} == {"stop"}
    assert ctx.release_parked("x")
    assert gen.num_free_blocks == gen.config.num_kv_blocks


def test_an_n_choices_request_cannot_be_a_moved_pull(tiny_engine):
    with pytest.raises(RequestValidationError, match="cannot be a moved one's pull"):
        tiny_engine.add_request(EngineRequest("k", [5, 6, 7], greedy(4), phase=Phase.GENERATION_ONLY,
                                              first_token_ids=[8, 9], n=2, kv_num_tokens=4))
    assert not tiny_engine.has_work()


def _seeded(n):
    return SamplingParams(max_tokens=n, temperature=0.9, seed=4321, ignore_eos=True)


def _step_until_moved(eng, tokens, max_steps=100):
    """Step ``eng`` to idle; the outputs with a finish reason (every token recorded in ``tokens``)."""
    finals = []
    for _ in range(max_steps):
        if not eng.has_work():
            break
        for o in eng.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals.append(o)
    return finals


def _continue_choice(dst, src, out, params, rid):
    """Continue a moved choice on ``dst`` as an n = 1 generation_only pull with its choice index (as a
    target gen server does: copy the blocks the KVPull names from the parked ones); returns (its
    tokens, tokens computed in the first step after the KV landed)."""
    tokens, _, first_step = _continue(dst, src, out, params, rid)
    return tokens, first_step


def test_move_out_parks_each_choice_and_targets_continue_them(tiny_engine_factory):
    """A drain with move_kv: a movable seeded n = 3 request moves choice by choice at one decode step
    boundary, each choice's blocks parked under ``"<id>-c<i>"`` (the full prompt block shared by all
    three, reference-counted); each continued on another engine as an n = 1 pull with its choice
    index computes exactly one token before it samples on and equals the undisturbed choice; the
    parks free every block only when the last one is released."""
    src, dst = (tiny_engine_factory(num_kv_blocks=64, block_size=16) for _ in range(2))
    prompt = [300 + (i * 7) % 997 for i in range(21)]  # one full prompt block (shared), one partial (copied)
    ref, _ = run_choices(src, [EngineRequest("ref", prompt, _seeded(12), n=3)])
    assert len({tuple(t) for t in choices_of(ref, "ref", 3)}) == 3  # seeded choices differ
    src.reset_prefix_cache()
    src.add_request(EngineRequest("three", prompt, _seeded(12), n=3, movable=True))
    tokens: dict = {}
    for _ in range(3):  # prefill + fork, then two decode steps
        for o in src.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    assert src.move_out() == ["three-c0", "three-c1", "three-c2"]
    finals = _step_until_moved(src, tokens)
    assert sorted(o.index for o in finals) == [0, 1, 2] and {o.finish_reason for o in finals} == {"moved"}
    assert [o.finished for o in finals].count(True) == 1 and not any(o.new_token_ids for o in finals)
    by_choice = {o.index: o for o in finals}
    assert [by_choice[i].moved.park_id for i in range(3)] == ["three-c0", "three-c1", "three-c2"]
    assert len({by_choice[i].parked_block_ids[0] for i in range(3)}) == 1  # the shared full prompt block
    assert len({by_choice[i].parked_block_ids[1] for i in range(3)}) == 3  # each choice's own copy
    for i in range(3):
        got, out = tokens[("three", i)], by_choice[i]
        assert 0 < len(got) < 12 and got == ref[("ref", i)][:len(got)]
        assert out.moved.token_ids == prompt + got and out.moved.kv_num_tokens == len(prompt) + len(got) - 1
        after, first_step = _continue_choice(dst, src, out, _seeded(12), f"t{i}")
        assert after == ref[("ref", i)] and first_step == 1  # first_gen_tokens re-emitted, then the rest
    assert src.stats()["requests_moved_out"] == 3
    assert src.release_parked("three-c0") and src.release_parked("three-c1")
    assert src.num_free_blocks < src.config.num_kv_blocks  # c2 still holds the shared prompt block
    assert src.release_parked("three-c2") and not src.release_parked("three")
    assert src.num_free_blocks == src.config.num_kv_blocks
    assert dst.num_free_blocks == dst.config.num_kv_blocks


def test_move_out_hands_choices_back_when_one_cannot_be_parked(tiny_engine_factory):
    """The fallback: a choice's park id is taken (a moved n = 1 request named ``"x-c1"`` is parked),
    so the n = 3 request ``x`` is handed back: every choice finishes with ``handed_back`` at one
    decode step boundary (no new token, its blocks freed), its tokens the undisturbed run's first."""
    eng = tiny_engine_factory(num_kv_blocks=64, block_size=16)
    prompt = [300 + (i * 7) % 997 for i in range(21)]
    ref, _ = run_choices(eng, [EngineRequest("ref", prompt, greedy(12), n=3)])
    eng.add_request(EngineRequest("x-c1", prompt, greedy(12), movable=True))
    tokens: dict = {}
    for _ in range(3):
        for o in eng.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    assert eng.move_out() == ["x-c1"]
    _step_until_moved(eng, tokens)
    eng.add_request(EngineRequest("x", prompt, greedy(12), n=3, movable=True))
    for _ in range(3):  # prefill + fork, then two decode steps
        for o in eng.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    assert eng.move_out() == [] and eng.requests_handed_back == 1
    finals = _step_until_moved(eng, tokens)
    assert sorted(o.index for o in finals) == [0, 1, 2] and {o.finish_reason for o in finals} == {"handed_back"}
    assert [o.finished for o in finals].count(True) == 1 and not any(o.new_token_ids for o in finals)
    for i in range(3):
        got = tokens[("x", i)]
        assert 0 < len(got) < 12 and got == ref[("ref", i)][:len(got)]
    assert eng.release_parked("x-c1") and eng.num_free_blocks == eng.config.num_kv_blocks


def test_move_out_passes_over_choices_and_they_finish(tiny_engine_factory):
    """A drain with move_kv calls move_out every step: the n = 1 movable request moves, the three
    choices of the n = 3 one stay and finish as an undisturbed run does."""
    eng = tiny_engine_factory(num_kv_blocks=64, block_size=16)
    prompt = [300 + (i * 7) % 997 for i in range(21)]
    ref, _ = run_choices(eng, [EngineRequest("ref", prompt, greedy(12), n=3)])
    eng.add_request(EngineRequest("three", prompt, greedy(12), n=3))
    eng.add_request(EngineRequest("one", prompt, greedy(12), movable=True))
    tokens, moved = {}, []
    for _ in range(1000):
        if not eng.has_work():
            break
        moved += eng.move_out()
        for o in eng.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finish_reason == "moved":
                assert o.request_id == "one" and o.finished
                eng.release_parked("one")
    assert moved == ["one"]
    assert choices_of(tokens, "three", 3) == choices_of(ref, "ref", 3)
    assert eng.num_free_blocks == eng.config.num_kv_blocks
