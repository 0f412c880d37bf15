"""Structured output through the engine (tiny random Llama, SmolLM2 vocabulary): outputs match their
grammar and end with "stop"; a mask changes nothing where greedy output already satisfies it;
context-only + generation-only (and a migration's replay of many output tokens) == colocated."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams
from engine.errors import RequestValidationError
from pdserve.structured_output import StructuredOutputSpec

from engine_testutil import PROMPTS, run_all

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
JSON = StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA)


def params(spec: StructuredOutputSpec | None, temperature: float = 0.0, seed: int | None = 0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 200), temperature=temperature, seed=seed,
                          structured_output=spec, **kw)


def test_sampled_json_schema_outputs_parse_validate_and_stop(tiny_engine):
    prompt = tiny_engine.tokenizer.encode(PROMPTS[0])
    reqs = [EngineRequest(f"j{s}", prompt, params(JSON, temperature=1.0, seed=s)) for s in range(8)]
    res = run_all(tiny_engine, reqs)
    texts = {r["text"] for r in res.values()}
    assert len(texts) > 1  # seeds differ, outputs differ: the mask did not force one answer
    for r in res.values():
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
        assert r["outputs"][-1].finish_reason == "stop"


def test_regex_and_choice_outputs_match_and_stop(tiny_engine):
    prompt = tiny_engine.tokenizer.encode(PROMPTS[2])
    specs = {"re": StructuredOutputSpec(kind="regex", regex="[0-9]{3}-[a-z]{2}"),
             "ch": StructuredOutputSpec(kind="choice", choices=("red", "green", "blue"))}
    res = run_all(tiny_engine, [EngineRequest(k, prompt, params(v, temperature=1.0, seed=3, max_tokens=64))
                                for k, v in specs.items()])
    text = res["re"]["text"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    assert res["ch"]["text"] in ("red", "green", "blue")
    assert res["re"]["outputs"][-1].finish_reason == res["ch"]["outputs"][-1].finish_reason == "stop"


def test_json_object_outputs_stay_inside_the_grammar(tiny_engine):
    """Random weights seldom close a free-form object within 48 tokens (SmolLM2 does: the slow
    test): every output is a prefix the grammar accepts, and one that stops parses as an object."""
    prompt = tiny_engine.tokenizer.encode(PROMPTS[2])
    spec = StructuredOutputSpec(kind="json_object")
    res = run_all(tiny_engine, [EngineRequest(f"o{s}", prompt, params(spec, temperature=1.0, seed=s, max_tokens=48))
                                for s in range(4)])
    for r in res.values():
        tiny_engine.grammars.matcher(spec, r["tokens"])  # raises TokenRejected if a token broke it
        assert r["text"].startswith("{")
        if r["outputs"][-1].finish_reason == "stop":
            assert isinstance(json.loads(r["text"]), dict)
        else:
            assert r["outputs"][-1].finish_reason == "length"


def clean_greedy(engine, n: int) -> list[tuple[list[int], list[int], str]]:
    """(prompt, greedy tokens, text) for the PROMPTS whose greedy output decodes to plain text
    (no special token, no partial UTF-8), so that the text itself can be a choice."""
    tok, out = engine.tokenizer, []
    reqs = [EngineRequest(f"g{i}", tok.encode(p), SamplingParams(max_tokens=n, temperature=0.0, logprobs=2))
            for i, p in enumerate(PROMPTS)]
    res = run_all(engine, reqs)
    for r, req in zip(res.values(), reqs):
        text = tok.decode(r["tokens"], skip_special_tokens=False)
        if text == r["text"] and "\ufffd" not in text and text.strip() and r["outputs"][-1].finish_reason == "length":
            out.append((req.prompt_token_ids, r, text))
    return out


def test_mask_on_and_off_give_the_same_greedy_output_when_it_already_satisfies_the_grammar(tiny_engine):
    cases = clean_greedy(tiny_engine, 6)
    assert len(cases) >= 3
    for i, (prompt, off, text) in enumerate(cases):
        spec = StructuredOutputSpec(kind="choice", choices=("zz" + text, text, text + "!"))
        on = run_all(tiny_engine, [EngineRequest(f"on{i}", prompt, params(spec, logprobs=2, max_tokens=6))])[f"on{i}"]
        assert on["tokens"] == off["tokens"] and on["text"] == text
        lp_on = [o for out in on["outputs"] for o in out.new_logprobs]
        lp_off = [o for out in off["outputs"] for o in out.new_logprobs]
        # logprobs: the raw distribution, before the mask (off ran in a batch of several: ~1e-6 apart)
        assert [(o.token_id, [t for t, _ in o.top]) for o in lp_on] == [(o.token_id, [t for t, _ in o.top]) for o in lp_off]
        assert [o.logprob for o in lp_on] == pytest.approx([o.logprob for o in lp_off], abs=1e-5)


def test_greedy_with_a_mask_is_the_argmax_over_allowed_tokens(tiny_engine):
    """A choice that excludes the unconstrained greedy text: the output differs, and is a choice."""
    (prompt, off, text), *_ = clean_greedy(tiny_engine, 6)
    spec = StructuredOutputSpec(kind="choice", choices=("alpha", "beta"))
    on = run_all(tiny_engine, [EngineRequest("x", prompt, params(spec))])["x"]
    assert on["text"] in ("alpha", "beta") and on["tokens"][0] != off["tokens"][0]
    assert on["outputs"][-1].finish_reason == "stop"


def test_a_spec_the_library_cannot_compile_is_refused_at_add_request(tiny_engine):
    bad = StructuredOutputSpec(kind="json_schema", json_schema={"type": "strnig"})
    with pytest.raises(RequestValidationError, match="strnig"):
        tiny_engine.add_request(EngineRequest("bad", [5, 6, 7], params(bad)))
    assert not tiny_engine.has_work()


def _ctx(engine, rid, prompt, sp):
    engine.add_request(EngineRequest(rid, prompt, sp, phase=Phase.CONTEXT_ONLY))
    outs = []
    while engine.has_work():
        outs += engine.step().outputs
    assert len(outs) == 1
    return outs[0]


def first_pull(engine, timeout_s: float = 120.0):
    """Step until the engine asks for its KV pull. A new engine's first structured-output request
    waits (off the step) for the grammar library's vocabulary view, so that may take a few steps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step = engine.step()
        assert step.outputs == []
        if step.kv_pulls:
            return step.kv_pulls[0]
    raise AssertionError(f"no KV pull within {timeout_s} s")


def _gen(engine, src, rid, prompt, first, parked, sp):
    engine.add_request(EngineRequest(rid, prompt, sp, phase=Phase.GENERATION_ONLY, first_token_ids=first))
    pull = first_pull(engine)
    engine.kv_cache[pull.block_ids] = src.kv_cache[parked]
    engine.kv_ready(rid, ok=True)
    tokens, last = [], None
    while engine.has_work():
        for o in engine.step().outputs:
            tokens += o.new_token_ids
            last = o
    return tokens, last.finish_reason


@pytest.mark.parametrize("replayed", [1, 5], ids=["handoff", "migration"])
def test_context_then_generation_equals_colocated_with_a_grammar(tiny_engine_factory, tiny_engine, replayed):
    """ctx samples token 0 under the mask; the gen engine rebuilds the matcher from the spec and the
    tokens so far (1 after a hand-off; ``replayed`` after a migration) and decodes on, seeded."""
    ctx, gen = tiny_engine, tiny_engine_factory(num_kv_blocks=64)
    prompt = tiny_engine.tokenizer.encode(PROMPTS[3])
    sp = params(JSON, temperature=1.0, seed=11)
    colo = run_all(ctx, [EngineRequest("co", prompt, sp)])["co"]
    assert len(colo["tokens"]) > replayed and colo["outputs"][-1].finish_reason == "stop"
    out = _ctx(ctx, "c", prompt, sp)
    assert out.new_token_ids == colo["tokens"][:1]
    tokens, reason = _gen(gen, ctx, "c", prompt, colo["tokens"][:replayed], out.parked_block_ids, sp)
    assert tokens == colo["tokens"] and reason == "stop"
    assert ctx.release_parked("c")
    assert gen.num_free_blocks == gen.config.num_kv_blocks


def test_generation_only_with_tokens_the_grammar_refuses_ends_in_abort(tiny_engine_factory, tiny_engine):
    gen = tiny_engine_factory(num_kv_blocks=64)
    prompt = tiny_engine.tokenizer.encode(PROMPTS[3])
    bad_first = tiny_engine.tokenizer.encode("hello")  # not the start of a JSON object
    gen.add_request(EngineRequest("r", prompt, params(JSON), phase=Phase.GENERATION_ONLY, first_token_ids=bad_first))
    first_pull(gen)
    gen.kv_ready("r", ok=True)
    outs = gen.step().outputs
    assert [o.finish_reason for o in outs] == ["abort"]
    assert gen.num_free_blocks == gen.config.num_kv_blocks
