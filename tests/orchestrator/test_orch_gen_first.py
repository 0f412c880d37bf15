"""schedule_style generation_first against fake servers: one gen request that waits on the ctx server."""

from __future__ import annotations

import time

import httpx
import pytest

from orch_fakes import text_of
from orch_sse import parse_sse, stream_text
from test_orch_flow import CHAT, COMPLETION, ENDPOINTS, answer_text


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_gen_request_names_the_ctx_server_and_waits_for_its_lease(make_cluster, path, body, chat, stream):
    c = make_cluster(schedule_style="generation_first")
    r = httpx.post(c.url + path, json={**body, "stream": stream}, timeout=10)
    assert r.status_code == 200, r.text
    text = stream_text(parse_sse(r.content), chat) if stream else answer_text(r.json(), chat)
    assert text == text_of(5)  # the first token (the ctx's) exactly once, then the rest
    (ctx_body,) = c.ctx[0].record.bodies
    (gen_body,) = c.gen[0].record.bodies
    ctx_dp, dp = ctx_body["disaggregated_params"], gen_body["disaggregated_params"]
    assert ctx_dp["request_type"] == "context_only" and ctx_body["stream"] is False
    assert dp == {"request_type": "generation_only", "disagg_request_id": ctx_dp["disagg_request_id"],
                  "ctx_url": c.ctx[0].server.url}  # nothing of the ctx answer: it did not exist yet
    assert c.gen[0].record.sources == list(c.ctx[0].record.leases)  # the wait returned the parked lease
    assert c.ctx[0].record.releases == []


def test_gen_request_leaves_with_the_ctx_request(make_cluster):
    """One round trip: the gen request reaches its server while the ctx server is still prefilling."""
    c = make_cluster(schedule_style="generation_first", behaviors={"ctx": [{"ctx_delay_s": 0.5}]})
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    assert r.status_code == 200 and stream_text(parse_sse(r.content), chat=False) == text_of(5)
    (ctx_t,), (gen_t,) = c.ctx[0].record.arrived_s, c.gen[0].record.arrived_s
    assert gen_t < ctx_t + 0.25  # long before the ctx answer (0.5 s after ctx_t)


def test_finished_at_first_token_cancels_the_gen_request(make_cluster):
    c = make_cluster(schedule_style="generation_first")
    r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1, "stream": True}, timeout=10)
    events = parse_sse(r.content)
    assert stream_text(events, chat=True) == text_of(1) and events[-1] == "[DONE]"
    assert c.gen[0].record.sources == []  # the gen server's wait said "finished": nothing pulled
    wait_for(lambda: httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"][0]["in_flight"] == 0)


def test_wait_timeout_is_a_504_not_retried(make_cluster):
    c = make_cluster(n_gen=2, schedule_style="generation_first", behaviors={"ctx": [{"ctx_delay_s": 0.5}]})
    for node in c.gen:
        node.behavior.ctx_wait_ms = 50
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout" and "ctx wait: timeout" in err["message"]
    assert [len(n.record.bodies) for n in c.gen] == [1, 0]  # not handed to another gen server
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)  # and the lease the late ctx answer named is released
