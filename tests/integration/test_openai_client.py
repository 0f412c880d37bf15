"""The official openai client against the orchestrator of a real (tiny-model) cluster."""

from __future__ import annotations

import pytest
from openai import NotFoundError, OpenAI, UnprocessableEntityError

from tests.integration.conftest import TINY_NAME


@pytest.fixture(scope="module")
def client(tiny_cluster) -> OpenAI:
    return OpenAI(base_url=tiny_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def colocated(tiny_cluster) -> OpenAI:
    return OpenAI(base_url=tiny_cluster.server_url("gen") + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def test_chat_non_stream_usage_and_max_tokens(client, colocated):
    kw = dict(model=TINY_NAME, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.total_tokens == r.usage.prompt_tokens + 10
    assert r.choices[0].message.content == colocated.chat.completions.create(**kw).choices[0].message.content


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_stop(client):
    base = client.completions.create(model=TINY_NAME, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[4:7]
    r = client.completions.create(model=TINY_NAME, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_completions_stream(client):
    pieces = [c.choices[0].text for c in client.completions.create(
        model=TINY_NAME, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True})]
    whole = client.completions.create(model=TINY_NAME, prompt="Once upon a time", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].text


def test_seed_is_reproducible_and_split_invariant(client, colocated):
    kw = dict(model=TINY_NAME, prompt="Random words:", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = colocated.completions.create(**kw).choices[0].text
    assert a == b == c
    assert client.completions.create(**{**kw, "seed": 99}).choices[0].text != a


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(UnprocessableEntityError, match="n: "):
        client.completions.create(model=TINY_NAME, prompt="x", n=17)  # n > 16 (n = 2 works: issue 15)
