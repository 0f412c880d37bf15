"""The official openai client against the orchestrator (with fake servers behind it)."""

from __future__ import annotations

import openai
import pytest

from orch_fakes import MODEL, text_of


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].message.content == text_of(4)
    assert r.usage.completion_tokens == 4


def test_chat_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text_of(6)
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_and_stream(client):
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=3)
    assert r.choices[0].text == text_of(3)
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text_of(3)


def test_models_and_errors(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
