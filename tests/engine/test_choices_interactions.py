"""n > 1 with the features beside it in the engine: each choice's own structured-output matcher
(colocated and ctx -> gen), and drain ``move_kv`` passing over n > 1 requests (never movable)."""
import json

import jsonschema
import pytest

from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams
from engine.errors import RequestValidationError
from pdserve.structured_output import StructuredOutputSpec

from engine_testutil import PROMPTS, greedy
from test_choices import choices_of, run_choices
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


def test_move_out_hands_a_movable_n_choices_request_back(tiny_engine_factory):
    """A drain with move_kv: a movable n = 3 request's choices all finish with ``handed_back`` at one
    decode step boundary (one final output, no new token in it, every block freed); the tokens
    they had equal the undisturbed run's first ones (the caller continues each choice from there)."""
    eng = tiny_engine_factory(num_kv_blocks=64, block_size=16)
    prompt = [300 + (i * 7) % 997 for i in range(21)]
    ref, _ = run_choices(eng, [EngineRequest("ref", prompt, greedy(12), n=3)])
    eng.add_request(EngineRequest("three", prompt, greedy(12), n=3, movable=True))
    tokens, finals, moved = {}, [], []
    for _ in range(3):  # prefill + fork, then two decode steps
        for o in eng.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    moved += eng.move_out()
    for _ in range(100):
        if not eng.has_work():
            break
        for o in eng.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            finals.append(o)
    assert moved == [] and eng.requests_handed_back == 1
    assert sorted(o.index for o in finals) == [0, 1, 2] and {o.finish_reason for o in finals} == {"handed_back"}
    assert [o.finished for o in finals].count(True) == 1 and not any(o.new_token_ids for o in finals)
    for i in range(3):
        got = tokens[("three", i)]
        assert 0 < len(got) < 12 and got == ref[("ref", i)][:len(got)]
    assert eng.num_free_blocks == eng.config.num_kv_blocks


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
