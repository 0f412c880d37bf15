"""/tokenize, /detokenize, /v1/models/{id}, /version and optional API keys, on the orchestrator and
on each server of an in-process tiny cluster (real sockets)."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.api_keys import MissingApiKey
from tests.integration.threaded_cluster import MODEL, ThreadedCluster, env_vars

WHERE = ["orchestrator", "ctx", "gen"]


def url_of(cluster, where: str) -> str:
    return cluster.url if where == "orchestrator" else cluster.server_url(where)


@pytest.mark.parametrize("where", WHERE)
def test_tokenize_round_trip(threaded_cluster, where):
    url = url_of(threaded_cluster, where)
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello tokenizer world",
                                            "return_token_strs": True}, timeout=10)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["count"] == len(d["tokens"]) > 0 and len(d["token_strs"]) == d["count"]
    assert d["max_model_len"] > 0
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": d["tokens"]}, timeout=10)
    assert back.status_code == 200 and back.json()["prompt"].strip() == "Hello tokenizer world"


@pytest.mark.parametrize("where", WHERE)
def test_tokenize_chat_counts_what_the_chat_route_counts(threaded_cluster, where):
    url = url_of(threaded_cluster, where)
    messages = [{"role": "user", "content": "Name three colours."}]
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=10).json()
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                       "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == tok["count"]


@pytest.mark.parametrize("where", WHERE)
def test_tokenize_errors(threaded_cluster, where):
    url = url_of(threaded_cluster, where)
    r = httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10)
    err = r.json()["error"]  # OpenAI's body: the string code, type invalid_request_error
    assert r.status_code == 404 and (err["code"], err["type"]) == ("model_not_found", "invalid_request_error")
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 404 and (err["code"], err["type"]) == ("model_not_found", "invalid_request_error")
    r = httpx.post(url + "/tokenize", json={"prompt": "x", "bogus": 1}, timeout=10)
    assert r.status_code == 422 and "bogus" in r.json()["error"]["message"]
    r = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("where", WHERE)
def test_model_card_and_version(threaded_cluster, where):
    url = url_of(threaded_cluster, where)
    card = httpx.get(f"{url}/v1/models/{MODEL}", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["max_model_len"] > 0
    missing = httpx.get(f"{url}/v1/models/other", timeout=10)
    err = missing.json()["error"]
    assert missing.status_code == 404 and (err["code"], err["type"]) == ("model_not_found", "invalid_request_error")
    assert httpx.get(url + "/version", timeout=10).json()["version"]


def test_model_card_with_openai_client(threaded_cluster):
    client = openai.OpenAI(base_url=threaded_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


@pytest.fixture(scope="module")
def keyed_cluster(tiny_model_dir, tmp_path_factory):
    """Client key on the orchestrator, another key on both pools' servers."""
    with env_vars({"T_CLIENT_KEY": "client-secret", "T_SERVER_KEY": "server-secret"}):
        cluster = ThreadedCluster.start(tiny_model_dir, tmp_path_factory.mktemp("keyed"),
                                        pools={"ctx": {"api_key_env": "T_SERVER_KEY"},
                                               "gen": {"api_key_env": "T_SERVER_KEY"}},
                                        orchestrator={"api_key_env": "T_CLIENT_KEY"})
    yield cluster
    cluster.stop()


def test_api_key_refuses_missing_and_wrong_keys(keyed_cluster):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    for url, good in ((keyed_cluster.url, "client-secret"), (keyed_cluster.server_url("gen"), "server-secret")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
                r = httpx.request(method, url + path, json=body if method == "POST" else None, headers=headers,
                                  timeout=10)
                assert r.status_code == 401, (url, path, headers)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(url + path, timeout=10).status_code == 200, path
        ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {good}"}, timeout=30)
        assert ok.status_code == 200, ok.text


def test_api_key_with_openai_client_disaggregated(keyed_cluster):
    """The orchestrator takes the client key and sends the servers' key to both phases."""
    good = openai.OpenAI(base_url=keyed_cluster.url + "/v1", api_key="client-secret", max_retries=0, timeout=30)
    for stream in (False, True):
        r = good.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                    stream=stream, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text
    tok = httpx.post(keyed_cluster.url + "/tokenize", json={"prompt": "Hi"},
                     headers={"Authorization": "Bearer client-secret"}, timeout=10)
    assert tok.status_code == 200, tok.text
    bad = openai.OpenAI(base_url=keyed_cluster.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert exc.value.code == "invalid_api_key"


def test_unset_key_variable_fails_at_start(tiny_model_dir, tmp_path):
    with pytest.raises(MissingApiKey, match="T_NOT_EXPORTED"):
        ThreadedCluster.start(tiny_model_dir, tmp_path, orchestrator={"api_key_env": "T_NOT_EXPORTED"})
