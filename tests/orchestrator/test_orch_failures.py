"""Failure rules: ctx retry, gen retry before the first byte, broken streams, lease release —
under both ``orchestrator.schedule_style`` values (generation_first: the fake gen servers really
wait on the fake ctx server's lease endpoint)."""

from __future__ import annotations

import time

import httpx
import pytest

from orch_fakes import text_of
from orch_sse import parse_sse, stream_text
from test_orch_flow import CHAT, COMPLETION


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture(params=["context_first", "generation_first"])
def style(request) -> str:
    return request.param


def disagg_ids(node) -> list[str]:
    return [b["disaggregated_params"]["disagg_request_id"] for b in node.record.bodies]


def test_ctx_5xx_retried_on_next_server_with_same_id(make_cluster, style):
    c = make_cluster(n_ctx=2, schedule_style=style)
    c.ctx[0].behavior.fail_status = 500
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text_of(5)
    assert disagg_ids(c.ctx[0]) == disagg_ids(c.ctx[1])  # round robin starts at ctx[0]
    assert len(disagg_ids(c.ctx[1])) == 1


def test_ctx_down_server_retried(make_cluster, style):
    c = make_cluster(n_ctx=2, health_interval_s=60.0, schedule_style=style)  # keep ctx[0] "ready" after it dies
    c.ctx[0].server.stop()
    r = httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 200, r.text
    assert len(c.ctx[1].record.bodies) == 1
    status = httpx.get(c.url + "/cluster/status", timeout=5).json()
    assert status["pools"]["ctx"]["servers"][0]["state"] == "unhealthy"
    assert "ConnectError" in status["pools"]["ctx"]["servers"][0]["last_error"]


def test_ctx_failing_everywhere_gives_503_naming_attempts(make_cluster, style):
    c = make_cluster(n_ctx=3, max_retries=1, schedule_style=style)
    for node in c.ctx:
        node.behavior.fail_status = 500
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "service_unavailable"
    assert "context phase failed on 2 ctx server(s)" in err["message"]
    assert c.ctx[0].server.url in err["message"] and "HTTP 500" in err["message"]
    assert sum(len(n.record.bodies) for n in c.ctx) == 2  # 1 + max_retries
    if style == "context_first":
        assert c.gen[0].record.bodies == []
    else:  # each attempt's gen request left with its ctx request (and was cancelled): no KV was handed over
        assert all("ctx_url" in b["disaggregated_params"] for b in c.gen[0].record.bodies)
        assert c.gen[0].record.sources == []


def test_gen_5xx_before_first_byte_retried(make_cluster, style):
    c = make_cluster(n_gen=2, schedule_style=style)
    c.gen[0].behavior.fail_status = 503
    r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert r.status_code == 200
    assert stream_text(parse_sse(r.content), chat=True) == text_of(5)
    lease1 = c.gen[1].record.bodies[0]["disaggregated_params"]["ctx_request_id"]
    if style == "context_first":
        lease0 = c.gen[0].record.bodies[0]["disaggregated_params"]["ctx_request_id"]
        assert lease0 == lease1  # the same parked KV, pulled by the second gen server
    else:  # gen 0 failed its generation_first request; the lease the ctx answer named went to gen 1
        assert "ctx_url" in c.gen[0].record.bodies[0]["disaggregated_params"]
        assert lease1 in c.ctx[0].record.leases
    assert c.ctx[0].record.releases == []


def test_gen_non_stream_retried(make_cluster, style):
    c = make_cluster(n_gen=2, schedule_style=style)
    c.gen[0].behavior.fail_status = 500
    r = httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text_of(5)


def test_gen_failing_everywhere_gives_503_and_releases_lease(make_cluster, style):
    c = make_cluster(n_gen=1, schedule_style=style)
    c.gen[0].behavior.fail_status = 500
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 503
    assert "generation phase failed" in r.json()["error"]["message"]
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)
    assert c.ctx[0].record.leases == set()


def test_gen_failing_everywhere_after_the_first_token_ends_the_stream_with_an_error(make_cluster):
    # The ctx server's first token went out at once (200), so the failure is an error event.
    c = make_cluster(n_gen=1)
    c.gen[0].behavior.fail_status = 500
    r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert r.status_code == 200
    events = parse_sse(r.content)
    assert stream_text(events, chat=True) == text_of(1)
    assert "generation phase failed" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)
    assert c.ctx[0].record.leases == set()


def test_gen_4xx_relayed_and_lease_released(make_cluster, style):
    c = make_cluster(schedule_style=style)
    c.gen[0].behavior.fail_status = 400
    r = httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "injected failure"
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)


def test_mid_stream_failure_ends_with_error_event_when_migration_is_off(make_cluster, style):
    c = make_cluster(schedule_style=style, migration_limit=0)
    c.gen[0].behavior.break_after_chunks = 2
    r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert r.status_code == 200
    events = parse_sse(r.content)
    assert stream_text(events, chat=True) == text_of(2)
    assert events[-1] == "[DONE]"
    assert "generation stream" in events[-2]["error"]["message"]
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)
    metrics = httpx.get(c.url + "/metrics", timeout=5).text
    assert 'pdserve_orchestrator_errors_total{kind="gen_stream"} 1.0' in metrics


def test_stream_without_done_gets_error_event(make_cluster, style):
    c = make_cluster(schedule_style=style)
    c.gen[0].behavior.no_done = True
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    events = parse_sse(r.content)
    assert stream_text(events, chat=False) == text_of(5)
    assert "without [DONE]" in events[-2]["error"]["message"] and events[-1] == "[DONE]"


def test_client_disconnect_aborts_gen_and_releases_lease(make_cluster, style):
    c = make_cluster(schedule_style=style)
    c.gen[0].behavior.chunk_delay_s = 0.1
    body = {**CHAT, "stream": True, "max_tokens": 100}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = b""
            for piece in r.iter_raw():  # the ctx's first token, then the gen stream's first chunk
                seen += piece
                if seen.count(b"data: ") >= 2:
                    break
    wait_for(lambda: c.gen[0].record.aborted_streams == 1)
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)
    assert c.gen[0].record.finished_streams == 0
    status = httpx.get(c.url + "/cluster/status", timeout=5).json()
    assert status["pools"]["gen"]["servers"][0]["in_flight"] == 0


def test_health_503_until_every_pool_has_a_ready_server(make_cluster):
    c = make_cluster(wait=False)
    c.gen[0].behavior.health_status = 503
    time.sleep(0.2)
    r = httpx.get(c.url + "/health", timeout=5)
    assert r.status_code == 503
    assert "gen pool has 0 of 1 ready servers" in r.json()["error"]["message"]
    r = httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 503 and "no ready gen server" in r.json()["error"]["message"]
    c.gen[0].behavior.health_status = 200
    c.wait_ready()
    r = httpx.get(c.url + "/health", timeout=5)
    assert r.json()["status"] == "ok"
    assert r.json()["pools"]["gen"]["ready"] == 1


def test_a_body_that_never_arrives_gets_408_and_the_connection_stays_usable(make_cluster):
    """The body read is bounded by request_timeout_s (orchestrator.front.read_body): a
    client that announces 400 bytes and sends 10 gets 408 in the OpenAI shape, nothing reaches a
    server, and the orchestrator goes on serving."""
    import socket

    c = make_cluster(request_timeout_s=0.3)
    host, port = c.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 400\r\n\r\n{\"model\":")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
        assert 0.25 < time.monotonic() - t0 < 5
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"error"' in answer and b"not received in time" in answer
    assert c.ctx[0].record.bodies == [] and c.gen[0].record.bodies == []
    r = httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 200
