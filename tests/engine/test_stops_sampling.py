"""Stop conditions, seeded sampling (reproducible, split-invariant), aborts."""
import pytest

from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams

from engine_testutil import PROMPTS, greedy, run_all


@pytest.fixture(scope="module")
def baseline(tiny_engine):
    prompt = tiny_engine.tokenizer.encode(PROMPTS[1])
    res = run_all(tiny_engine, [EngineRequest("base", prompt, greedy(40))])["base"]
    return prompt, res["tokens"], res["text"]


def test_stop_string_cuts_text_and_is_never_streamed(tiny_engine, baseline):
    prompt, _, text = baseline
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip(), "baseline text too short"
    res = run_all(tiny_engine, [EngineRequest("s", prompt, greedy(40, stop=["zzqq", stop]))])["s"]
    assert res["text"] == text[:text.find(stop)]
    assert res["outputs"][-1].finish_reason == "stop"
    assert len(res["tokens"]) < 40


def test_stop_token_and_max_tokens(tiny_engine, baseline):
    prompt, tokens, _ = baseline
    res = run_all(tiny_engine, [EngineRequest("t", prompt, greedy(40, stop_token_ids=[tokens[5]])),
                                EngineRequest("m", prompt, greedy(7))])
    stop_at = tokens.index(tokens[5]) + 1
    assert res["t"]["tokens"] == tokens[:stop_at]
    assert res["t"]["outputs"][-1].finish_reason == "stop"
    assert res["m"]["tokens"] == tokens[:7]
    last = res["m"]["outputs"][-1]
    assert (last.finish_reason, last.num_output_tokens, last.num_prompt_tokens) == \
        ("length", 7, len(prompt))


def test_text_deltas_concatenate_to_decode(tiny_engine, baseline):
    _, tokens, text = baseline
    assert text == tiny_engine.tokenizer.decode(tokens)


def test_max_model_len_ends_with_length(tiny_engine_factory, baseline):
    eng = tiny_engine_factory(num_kv_blocks=32, max_model_len=20)
    prompt = baseline[0][:15]
    res = run_all(eng, [EngineRequest("l", prompt, greedy(None))])["l"]
    assert len(res["tokens"]) == 20 - len(prompt)
    assert res["outputs"][-1].finish_reason == "length"


SAMPLED = dict(temperature=0.9, top_k=50, top_p=0.9, ignore_eos=True, max_tokens=16)


def test_seeded_sampling_reproducible(tiny_engine, baseline):
    # the same seed draws the same tokens alone and in a batch of 8 with other requests
    # (greedy, unseeded, other seeds, top-k/top-p/temperature, other prompts)
    prompt = baseline[0]
    others = [dict(temperature=0.0), dict(), dict(seed=1), dict(seed=2, top_k=5),
              dict(seed=3, top_p=0.5), dict(seed=4, temperature=1.5), dict(seed=7, top_k=0)]
    a = run_all(tiny_engine, [EngineRequest("a", prompt, SamplingParams(seed=7, **SAMPLED))])
    b = run_all(tiny_engine, [EngineRequest(f"x{i}", prompt[i:], SamplingParams(**{**SAMPLED, **kw}))
                              for i, kw in enumerate(others)] +
                [EngineRequest("b", prompt, SamplingParams(seed=7, **SAMPLED))])
    c = run_all(tiny_engine, [EngineRequest("c", prompt, SamplingParams(seed=8, **SAMPLED))])
    assert a["a"]["tokens"] == b["b"]["tokens"]
    assert a["a"]["tokens"] != c["c"]["tokens"]
    assert a["a"]["tokens"] != baseline[1][:16]


def test_unseeded_requests_get_their_own_random_seed(tiny_engine, baseline):
    prompt = baseline[0]
    res = run_all(tiny_engine, [EngineRequest(f"u{i}", prompt, SamplingParams(**SAMPLED))
                                for i in range(2)])
    assert res["u0"]["tokens"] != res["u1"]["tokens"]   # 16 draws from a 49,152-token vocab


def test_seeded_sampling_split_invariant(tiny_engine, tiny_engine_factory, baseline):
    prompt = baseline[0]
    colocated = run_all(tiny_engine, [EngineRequest("co", prompt,
                                                    SamplingParams(seed=3, **SAMPLED))])
    tiny_engine.add_request(EngineRequest("ctx", prompt, SamplingParams(seed=3, **SAMPLED),
                                          phase=Phase.CONTEXT_ONLY))
    out = tiny_engine.step().outputs[0]
    gen = tiny_engine_factory(num_kv_blocks=32)
    gen.add_request(EngineRequest("g", prompt, SamplingParams(seed=3, **SAMPLED),
                                  phase=Phase.GENERATION_ONLY, first_token_ids=out.new_token_ids))
    pull = gen.step().kv_pulls[0]
    gen.kv_cache[pull.block_ids] = tiny_engine.kv_cache[out.parked_block_ids]
    gen.kv_ready("g", ok=True)
    tokens = []
    while gen.has_work():
        tokens += [t for o in gen.step().outputs for t in o.new_token_ids]
    assert tiny_engine.release_parked("ctx")
    assert tokens == colocated["co"]["tokens"]


def test_abort_running_request(tiny_engine, baseline):
    eng = tiny_engine
    eng.add_request(EngineRequest("ab", baseline[0], greedy(30)))
    eng.step()
    eng.step()
    eng.abort_request("ab")
    outs = eng.step().outputs
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("ab", True, "abort")]
    assert not eng.has_work() and eng.num_free_blocks == eng.config.num_kv_blocks
