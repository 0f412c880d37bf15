"""The ctx → gen request path against fake servers: chat and completions, stream and not."""

from __future__ import annotations

import time

import httpx
import pytest

from orch_fakes import MODEL, text_of
from orch_sse import parse_sse, stream_text

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"model": MODEL, "prompt": "Once upon", "max_tokens": 5}
ENDPOINTS = [("/v1/chat/completions", CHAT, True), ("/v1/completions", COMPLETION, False)]


def answer_text(answer: dict, chat: bool) -> str:
    c = answer["choices"][0]
    return c["message"]["content"] if chat else c["text"]


@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_non_stream_runs_ctx_then_gen(cluster, path, body, chat):
    r = httpx.post(cluster.url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert answer_text(r.json(), chat) == text_of(5)
    assert r.json()["usage"]["completion_tokens"] == 5
    (ctx_body,) = cluster.ctx[0].record.bodies
    (gen_body,) = cluster.gen[0].record.bodies
    assert ctx_body["stream"] is False and "stream_options" not in ctx_body
    assert ctx_body["max_tokens"] == 5  # the client's, so the ctx server knows whether token 1 ends it
    assert ctx_body["disaggregated_params"]["request_type"] == "context_only"
    dp = gen_body["disaggregated_params"]
    assert dp["request_type"] == "generation_only"
    assert dp["disagg_request_id"] == ctx_body["disaggregated_params"]["disagg_request_id"]
    assert dp["ctx_request_id"].startswith("lease-") and dp["first_gen_tokens"] == [0]
    assert cluster.ctx[0].record.releases == []


@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_stream_relays_gen_sse(cluster, path, body, chat):
    req = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(cluster.url + path, json=req, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]"
    assert stream_text(events, chat) == text_of(5)
    assert events[-2]["usage"]["completion_tokens"] == 5
    (gen_body,) = cluster.gen[0].record.bodies
    assert gen_body["stream"] is True and gen_body["stream_options"] == {"include_usage": True}
    assert cluster.ctx[0].record.bodies[0]["stream"] is False


@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_finished_at_first_token_returns_ctx_answer(cluster, path, body, chat):
    r = httpx.post(cluster.url + path, json={**body, "max_tokens": 1}, timeout=10)
    assert r.status_code == 200
    assert answer_text(r.json(), chat) == text_of(1)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert "disaggregated_params" not in r.json()["choices"][0]
    assert cluster.gen[0].record.bodies == []


@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_finished_at_first_token_converted_to_sse(cluster, path, body, chat):
    req = {**body, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(cluster.url + path, json=req, timeout=10)
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]"
    assert stream_text(events, chat) == text_of(1)
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    assert finishes[-1] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 1
    if chat:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert cluster.gen[0].record.bodies == []


def test_ctx_4xx_is_relayed_without_retry(make_cluster):
    c = make_cluster(n_ctx=2)
    body = {**CHAT, "messages": [{"role": "user", "content": "TOO_LONG prompt"}]}
    r = httpx.post(c.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "prompt is too long"
    assert r.json()["error"]["param"] == "messages"
    assert sum(len(n.record.bodies) for n in c.ctx) == 1
    assert c.gen[0].record.bodies == []


def test_models_lists_the_topology_model(cluster):
    r = httpx.get(cluster.url + "/v1/models", timeout=5)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert r.json()["data"][0]["max_model_len"] == 2048  # what the servers report


def test_models_reports_the_smallest_context_window_of_the_ready_servers(make_cluster):
    """A request passes one ctx and one gen server: the cluster's window is the smallest one."""
    c = make_cluster(n_ctx=2, behaviors={"ctx": [{}, {"max_model_len": 1536}], "gen": [{"max_model_len": 4096}]})
    deadline = time.monotonic() + 10
    while httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["ctx"]["ready"] < 2:
        assert time.monotonic() < deadline, "the second ctx server never turned ready"
        time.sleep(0.05)
    assert httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"] == 1536


def test_round_robin_spreads_over_ctx_and_gen(make_cluster):
    c = make_cluster(n_ctx=2, n_gen=2)
    for _ in range(4):
        assert httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    assert [len(n.record.bodies) for n in c.ctx] == [2, 2]
    assert [len(n.record.bodies) for n in c.gen] == [2, 2]


def test_cluster_status_and_metrics(cluster):
    httpx.post(cluster.url + "/v1/completions", json=COMPLETION, timeout=10)
    status = httpx.get(cluster.url + "/cluster/status", timeout=5).json()
    assert [s["state"] for s in status["pools"]["ctx"]["servers"]] == ["ready"]
    assert status["pools"]["gen"]["servers"][0]["url"] == cluster.gen[0].server.url
    assert status["pools"]["gen"]["servers"][0]["in_flight"] == 0
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    assert 'pdserve_orchestrator_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert "pdserve_orchestrator_ttft_seconds_count" in text
    assert "pdserve_orchestrator_ctx_phase_seconds_count 1.0" in text
    assert 'pdserve_orchestrator_pool_servers{pool="gen",state="ready"} 1.0' in text
