"""OpenAI sampling fields through the orchestrator with the official ``openai`` client, stream and
not, disaggregated (ctx samples the first token, gen the rest) == colocated, on an in-process tiny
cluster; logprobs and the repetition penalty against HF transformers on the same weights (fp32)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.integration.threaded_cluster import MODEL

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # token ids: 2.5 KV blocks of 4
IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def genfirst_url(threaded_cluster) -> str:
    """A second orchestrator over the same servers, ``schedule_style: generation_first``."""
    return threaded_cluster.add_orchestrator("orchestrator-genfirst", schedule_style="generation_first")


@pytest.fixture(scope="module", params=["context_first", "generation_first"])
def clients(request, threaded_cluster) -> dict[str, openai.OpenAI]:
    """``disagg``: the orchestrator of one schedule style (generation_first: the gen server gets
    the first token and its logprobs from the ctx server's lease answer, not from the
    orchestrator); ``colocated``: the gen server by itself."""
    orch = threaded_cluster.url if request.param == "context_first" else request.getfixturevalue("genfirst_url")
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for name, url in (("disagg", orch), ("colocated", threaded_cluster.server_url("gen")))}


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i = log_softmax of the logits after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def token_ids(strs: list[str]) -> list[int]:
    return [int(s.removeprefix("token_id:")) for s in strs]


def completion(client, stream: bool, **kw) -> dict:
    """(text, finish_reason, logprobs dict or None, usage) of one completions call."""
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
    extra = {**IDS, **kw.pop("extra_body", {})}
    if not stream:
        r = client.completions.create(**kw, extra_body=extra)
        c = r.choices[0]
        return {"text": c.text, "finish": c.finish_reason,
                "logprobs": c.logprobs.model_dump() if c.logprobs else None, "tokens": r.usage.completion_tokens}
    text, finish, lp, usage = [], None, None, None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                           extra_body=extra):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.text)
            finish = c.finish_reason or finish
            if c.logprobs:
                part = c.logprobs.model_dump()
                lp = part if lp is None else {k: lp[k] + part[k] for k in lp}
    return {"text": "".join(text), "finish": finish, "logprobs": lp, "tokens": usage.completion_tokens}


def both(clients, stream: bool, **kw) -> dict:
    """The disaggregated answer, asserted equal to the colocated one (logprobs within 1e-5: the
    colocated prompt may be partly served by the gen server's prefix cache, computed in chunks)."""
    a, b = (completion(clients[k], stream, **kw) for k in ("disagg", "colocated"))
    assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
    if a["logprobs"] is not None:
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-5)
    return a


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_hf(clients, hf, stream):
    got = both(clients, stream, logprobs=5)
    out = token_ids(got["logprobs"]["tokens"])
    ref = hf_logprobs(hf, PROMPT + out)
    for i, (tok, lp, top) in enumerate(zip(out, got["logprobs"]["token_logprobs"], got["logprobs"]["top_logprobs"])):
        row = ref[len(PROMPT) - 1 + i]
        assert tok == int(row.argmax())  # greedy
        assert lp == pytest.approx(row[tok].item(), abs=1e-4)
        best = row.topk(5)
        assert token_ids(list(top)) == best.indices.tolist()  # the chosen token is among the top 5 here
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert got["logprobs"]["text_offset"][0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_hf(clients, hf, threaded_cluster, stream):
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = httpx.post(threaded_cluster.url + "/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    answers = []
    for name in ("disagg", "colocated"):
        kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body=IDS)
        if stream:
            content = [e for c in clients[name].chat.completions.create(**kw, stream=True)
                       for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        else:
            content = clients[name].chat.completions.create(**kw).choices[0].logprobs.content
        answers.append(content)
    assert [e.token for e in answers[0]] == [e.token for e in answers[1]] and len(answers[0]) == 6
    out = token_ids([e.token for e in answers[0]])
    ref = hf_logprobs(hf, prompt + out)
    for i, e in enumerate(answers[0]):
        row = ref[len(prompt) - 1 + i]
        assert e.logprob == pytest.approx(row[out[i]].item(), abs=1e-4)
        assert token_ids([t.token for t in e.top_logprobs]) == row.topk(3).indices.tolist()
        assert e.bytes == list(e.token.encode())


def test_logprobs_of_sampled_tokens_are_the_raw_distribution(clients, hf):
    """temperature 1.7 + top_k 3 + a penalty pick the tokens; logprobs stay HF's plain log-softmax."""
    got = both(clients, False, logprobs=1, temperature=1.7, seed=11, presence_penalty=1.0, extra_body={"top_k": 3})
    out = token_ids(got["logprobs"]["tokens"])
    ref = hf_logprobs(hf, PROMPT + out)
    for i, lp in enumerate(got["logprobs"]["token_logprobs"]):
        assert lp == pytest.approx(ref[len(PROMPT) - 1 + i, out[i]].item(), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_prompt_logprobs_even_on_a_prefix_cache_hit(clients, hf, threaded_cluster, stream):
    first = both(clients, stream, logprobs=2, echo=True, max_tokens=3)
    again = both(clients, stream, logprobs=2, echo=True, max_tokens=3)  # the prompt's blocks are cached now
    assert again == first
    lp = first["logprobs"]
    toks = token_ids(lp["tokens"])
    assert toks[:len(PROMPT)] == PROMPT and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(hf, toks)
    for i in range(1, len(toks)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, toks[i]].item(), abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    plain = both(clients, stream, echo=True, max_tokens=3, extra_body={"return_tokens_as_token_ids": False})
    prompt_text = httpx.post(threaded_cluster.url + "/detokenize", json={"tokens": PROMPT}, timeout=10).json()["prompt"]
    assert plain["text"].startswith(prompt_text) and len(plain["text"]) > len(prompt_text)


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_forces_a_token(clients, stream):
    got = both(clients, stream, logprobs=0, logit_bias={"777": 100})
    assert token_ids(got["logprobs"]["tokens"]) == [777] * 8
    base = both(clients, stream, logprobs=0)
    assert token_ids(base["logprobs"]["tokens"]) != [777] * 8  # negative control


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_a_stop_token_across_the_handoff(clients, stream):
    base = both(clients, stream, logprobs=0)
    first = token_ids(base["logprobs"]["tokens"])[0]
    stopped = both(clients, stream, logprobs=0, extra_body={"stop_token_ids": [first], "ignore_eos": True})
    assert stopped["finish"] == "stop" and stopped["tokens"] == 1  # the ctx server's first token stops it
    held = both(clients, stream, logprobs=0, extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert held["tokens"] >= 4 and first not in token_ids(held["logprobs"]["tokens"])[:4]


@pytest.mark.parametrize("stream", [False, True])
def test_repetition_penalty_equals_hf_generate(clients, hf, stream):
    # Below 1 the penalty favours seen tokens: on random weights that changes the greedy path for sure.
    got = both(clients, stream, logprobs=0, max_tokens=12, extra_body={"repetition_penalty": 0.3})
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, repetition_penalty=0.3,
                      eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert token_ids(got["logprobs"]["tokens"]) == ref
    plain = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(PROMPT):].tolist()
    assert plain != ref  # the penalty matters on these weights


@pytest.mark.parametrize("stream", [False, True])
def test_frequency_and_presence_penalties_change_repeats(clients, stream):
    base = token_ids(both(clients, stream, logprobs=0, max_tokens=24)["logprobs"]["tokens"])
    for kw in ({"frequency_penalty": -2.0}, {"presence_penalty": -2.0}):  # negative: repeats are favoured
        got = token_ids(both(clients, stream, logprobs=0, max_tokens=24, **kw)["logprobs"]["tokens"])
        assert got != base
        assert max(got.count(t) for t in got) > max(base.count(t) for t in base)


@pytest.mark.parametrize("stream", [False, True])
def test_min_p_one_keeps_only_the_argmax(clients, stream):
    greedy = both(clients, stream, max_tokens=12)["text"]
    sampled = both(clients, stream, max_tokens=12, temperature=1.5, seed=3)["text"]
    assert both(clients, stream, max_tokens=12, temperature=1.5, seed=3, extra_body={"min_p": 1.0})["text"] == greedy
    assert sampled != greedy  # negative control: without min_p the seed draws other tokens


def test_continuous_usage_stats(clients):
    for name in ("disagg", "colocated"):
        chunks = list(clients[name].completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=IDS))
        counts = [c.usage.completion_tokens for c in chunks if c.choices]
        assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage for c in chunks)


def test_fields_that_change_nothing_are_accepted(clients, threaded_cluster):
    noop = {"user": "u1", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True,
            "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "p"}
    for name, client in clients.items():
        for stream in (False, True):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                      extra_body={"ignore_eos": True})
            plain = client.chat.completions.create(**kw, stream=stream)
            dressed = client.chat.completions.create(**kw, stream=stream, **noop)
            text = (lambda r: "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream
                    else r.choices[0].message.content)
            assert text(dressed) == text(plain), name
    for url in (threaded_cluster.url, threaded_cluster.server_url("ctx")):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "bogus_field": 1}, timeout=10)
        assert r.status_code == 422 and "bogus_field" in r.json()["error"]["message"]


def test_refusals_are_clear(clients):
    c = clients["disagg"]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        c.completions.create(model=MODEL, prompt="x", best_of=2)
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 3})
    with pytest.raises(openai.UnprocessableEntityError, match="top_logprobs"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.UnprocessableEntityError):
        c.completions.create(model=MODEL, prompt="x", presence_penalty=2.5)
    with pytest.raises(openai.UnprocessableEntityError, match="logit_bias"):
        c.completions.create(model=MODEL, prompt="x", logit_bias={"abc": 1})
    with pytest.raises(openai.BadRequestError, match="out of range"):
        c.completions.create(model=MODEL, prompt="x", logit_bias={str(10**8): 1})
