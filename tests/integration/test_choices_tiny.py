"""``n`` > 1 through the orchestrator with the official ``openai`` client, stream and not, on the
in-process tiny cluster: one prefill on the ctx server, n decodes on the gen server (engine.choices);
disaggregated == colocated (the gen server by itself)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.integration.threaded_cluster import MODEL

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 2.5 KV blocks of 4: a partial last block per choice
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def clients(threaded_cluster) -> dict[str, openai.OpenAI]:
    """``disagg``: the orchestrator; ``colocated``: the gen server by itself."""
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for name, url in (("disagg", threaded_cluster.url), ("colocated", threaded_cluster.server_url("gen")))}


def completions(client, stream: bool, prompt=PROMPT, **kw) -> dict:
    """{"texts": index -> text, "finish": index -> finish_reason, "usage", "order": chunk indexes}."""
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11, **kw}
    if not stream:
        r = client.completions.create(**kw, extra_body=EXTRA)
        return {"texts": {c.index: c.text for c in r.choices}, "finish": {c.index: c.finish_reason for c in r.choices},
                "usage": r.usage, "order": [c.index for c in r.choices]}
    texts, finish, usage, order = {}, {}, None, []
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                           extra_body=EXTRA):
        usage = chunk.usage or usage
        for c in chunk.choices:
            order.append(c.index)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return {"texts": texts, "finish": finish, "usage": usage, "order": order}


def chat(client, stream: bool, **kw) -> dict:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 6, "n": 2,
          "temperature": 1.0, "seed": 5, **kw}
    if not stream:
        r = client.chat.completions.create(**kw, extra_body=EXTRA)
        return {"texts": {c.index: c.message.content for c in r.choices}, "usage": r.usage, "roles": None}
    texts, roles, usage = {}, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                extra_body=EXTRA):
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.index not in texts:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return {"texts": texts, "usage": usage, "roles": roles}


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_choices_reproducible_distinct_and_usage(clients, stream):
    a, b = (completions(clients["disagg"], stream) for _ in range(2))
    assert a["texts"] == b["texts"] and sorted(a["texts"]) == [0, 1, 2]
    assert len(set(a["texts"].values())) == 3, a["texts"]
    assert a["finish"] == {0: "length", 1: "length", 2: "length"}
    assert (a["usage"].prompt_tokens, a["usage"].completion_tokens, a["usage"].total_tokens) == (10, 24, 34)


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_equals_colocated(clients, stream):
    assert completions(clients["disagg"], stream)["texts"] == completions(clients["colocated"], stream)["texts"]
    assert chat(clients["disagg"], stream)["texts"] == chat(clients["colocated"], stream)["texts"]


def test_greedy_n2_equals_n1(clients):
    one = completions(clients["disagg"], False, n=1, temperature=0)["texts"][0]
    for stream in (False, True):
        assert completions(clients["disagg"], stream, n=2, temperature=0)["texts"] == {0: one, 1: one}


def test_stream_interleaves_and_reassembles(clients):
    streamed = completions(clients["disagg"], True, max_tokens=12)
    order = streamed["order"]
    assert any(x > y for x, y in zip(order, order[1:])), order  # a later chunk goes back to a lower index
    assert streamed["texts"] == completions(clients["disagg"], False, max_tokens=12)["texts"]
    got = chat(clients["disagg"], True)
    assert got["roles"] == {0: "assistant", 1: "assistant"}
    assert got["texts"] == chat(clients["disagg"], False)["texts"]
    assert got["usage"].completion_tokens == 12


def _prefill_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^pdserve_prefill_tokens_total (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_one_prefill(clients, threaded_cluster, stream):
    prompt = [40 + 7 * i + int(stream) for i in range(13)]  # a prompt no other test sends: nothing cached
    ctx, gen = (threaded_cluster.server_url(r) for r in ("ctx", "gen"))
    before = _prefill_tokens(ctx), _prefill_tokens(gen)
    got = completions(clients["disagg"], stream, prompt=prompt, n=4)
    assert len(got["texts"]) == 4
    cached = got["usage"].prompt_tokens_details.cached_tokens or 0
    assert _prefill_tokens(ctx) - before[0] == len(prompt) - cached == 13
    assert _prefill_tokens(gen) == before[1]  # the gen server pulled the prompt's KV once, computed none of it
    # the prompt + 6 tokens: its first 3 blocks of 4 are in the ctx server's cache now
    longer, before = prompt + [900 + i for i in range(6)], _prefill_tokens(ctx)
    got = completions(clients["disagg"], stream, prompt=longer, n=3)
    assert len(got["texts"]) == 3 and got["usage"].prompt_tokens_details.cached_tokens == 12
    assert _prefill_tokens(ctx) - before == len(longer) - 12 == 7


def test_refusals(clients):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        clients["disagg"].completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, best_of=3)
    with pytest.raises(openai.UnprocessableEntityError, match="n"):
        clients["disagg"].completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=17)


def test_a_movable_n_choices_request_is_served_and_choice_index_needs_n_1(threaded_cluster):
    """A movable n > 1 stream is served (a move_kv drain hands it back, test_drain_move.py); a
    ``choice_index`` (an n = 1 continuation of one choice) with n > 1 is a 400 naming ``n``, and an
    n = 1 stream with ``choice_index`` 1 carries ``index: 1``."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2, "stream": True,
            "disaggregated_params": {"request_type": "context_and_generation", "movable": True,
                                     "stream_token_ids": True}}
    url = threaded_cluster.server_url("gen") + "/v1/completions"
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 200 and "[DONE]" in r.text, r.text
    one = {**body, "disaggregated_params": {**body["disaggregated_params"], "choice_index": 1}}
    r = httpx.post(url, json=one, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = httpx.post(url, json={**one, "n": 1}, timeout=30)
    assert r.status_code == 200 and '"index":1' in r.text and '"index":0' not in r.text, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_stops_on_its_own_stop_string(clients, stream):
    free = completions(clients["disagg"], False, max_tokens=16)["texts"]
    stop = free[1][len(free[1]) // 2:len(free[1]) // 2 + 2]  # a piece from the middle of choice 1
    assert stop.strip(), free
    got = completions(clients["disagg"], stream, max_tokens=16, stop=[stop])
    for i, text in free.items():
        cut = text.find(stop)
        assert got["texts"][i] == (text if cut < 0 else text[:cut]), (i, stop)
        assert got["finish"][i] == ("length" if cut < 0 else "stop")
    assert got["finish"][1] == "stop"
    assert completions(clients["colocated"], stream, max_tokens=16, stop=[stop])["texts"] == got["texts"]


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_has_its_logprobs(clients, stream):
    def run(client):
        kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": 2}
        lps = {}
        if not stream:
            for c in client.completions.create(**kw, extra_body=EXTRA).choices:
                lps[c.index] = c.logprobs.token_logprobs
            return lps
        for chunk in client.completions.create(**kw, stream=True, extra_body=EXTRA):
            for c in chunk.choices:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
        return lps

    got, want = run(clients["disagg"]), run(clients["colocated"])
    assert sorted(got) == [0, 1] and all(len(v) == 5 for v in got.values())
    assert got[0] != got[1]
    for i in (0, 1):
        assert got[i] == pytest.approx(want[i], abs=1e-5)
