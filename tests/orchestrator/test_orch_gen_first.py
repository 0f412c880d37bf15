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
    if stream:  # a client's stream may pass through as bytes: every chunk carries the head asked for
        head = dp.pop("relay_head")
        assert head["id"].startswith("chatcmpl-" if chat else "cmpl-") and abs(head["created"] - time.time()) < 60
        assert {e["id"] for e in parse_sse(r.content) if isinstance(e, dict)} == {head["id"]}
    assert dp == {"request_type": "generation_only", "disagg_request_id": ctx_dp["disagg_request_id"],
                  "ctx_url": c.ctx[0].server.url,  # nothing of the ctx answer: it did not exist yet
                  # the relay keeps the ids (migration) and may move it off a gen server that drains;
                  # a non-stream request too: it is streamed internally from the gen server
                  "stream_token_ids": True, "movable": True}
    assert gen_body["stream"] is True
    if not stream:  # the internal stream asks for the usage chunk that makes the answer's usage
        assert gen_body["stream_options"] == {"include_usage": True}
        assert r.json()["usage"]["completion_tokens"] == 5
    assert c.gen[0].record.sources == list(c.ctx[0].record.leases)  # the wait returned the parked lease
    assert c.ctx[0].record.releases == []


def test_with_migration_off_a_non_stream_answer_is_the_gen_servers_json(make_cluster):
    c = make_cluster(schedule_style="generation_first", migration_limit=0)
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": False}, timeout=10)
    assert r.status_code == 200 and answer_text(r.json(), chat=False) == text_of(5), r.text
    (gen_body,) = c.gen[0].record.bodies
    assert gen_body["stream"] is False and "movable" not in gen_body["disaggregated_params"]


def test_gen_request_leaves_with_the_ctx_request(make_cluster):
    """One round trip: the gen request reaches its server while the ctx server is still prefilling."""
    c = make_cluster(schedule_style="generation_first", behaviors={"ctx": [{"ctx_delay_s": 0.5}]})
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    assert r.status_code == 200 and stream_text(parse_sse(r.content), chat=False) == text_of(5)
    (ctx_t,), (gen_t,) = c.ctx[0].record.arrived_s, c.gen[0].record.arrived_s
    assert gen_t < ctx_t + 0.25  # long before the ctx answer (0.5 s after ctx_t)


def test_ctx_request_is_written_before_the_gen_request(make_cluster, monkeypatch):
    """The ctx request is the TTFT's critical path: it leaves first, the gen request right after it
    (before the ctx answer is awaited), both on the upstream client's hot path."""
    from orchestrator.h1client import H1Client

    c = make_cluster(schedule_style="generation_first", behaviors={"ctx": [{"ctx_delay_s": 0.3}]})
    written: list[str] = []
    start = H1Client.start

    async def recording_start(self, base_url, path, body, headers=()):
        pending = await start(self, base_url, path, body, headers)
        written.append(base_url)  # after start returned: the request is on its connection
        return pending

    monkeypatch.setattr(H1Client, "start", recording_start)
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    assert r.status_code == 200 and stream_text(parse_sse(r.content), chat=False) == text_of(5)
    assert written[:2] == [c.ctx[0].server.url, c.gen[0].server.url]
    (ctx_t,), (gen_t,) = c.ctx[0].record.arrived_s, c.gen[0].record.arrived_s
    assert gen_t < ctx_t + 0.15  # and it did not wait for the ctx answer (0.3 s after ctx_t)


def test_finished_at_first_token_cancels_the_gen_request(make_cluster):
    c = make_cluster(schedule_style="generation_first")
    r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1, "stream": True}, timeout=10)
    events = parse_sse(r.content)
    assert stream_text(events, chat=True) == text_of(1) and events[-1] == "[DONE]"
    assert c.gen[0].record.sources == []  # the gen server's wait said "finished": nothing pulled
    wait_for(lambda: httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"][0]["in_flight"] == 0)


def test_wait_timeout_is_a_504_not_retried(make_cluster):
    # The gen server's wait (50 ms) runs out before the ctx server answers: the ctx answer waits
    # for that timeout and then 0.3 s for the gen server's 504 to reach the orchestrator (a fixed
    # 0.5 s from the ctx request raced the gen side's whole wait path under load, and a late 504
    # meets a stream that already has its first token: an error event, not this 504).
    c = make_cluster(n_gen=2, schedule_style="generation_first",
                     behaviors={"ctx": [{"ctx_answer_after_wait_timeout": True, "ctx_delay_s": 0.3}]})
    for node in c.gen:
        node.behavior.ctx_wait_ms = 50
    r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout" and "ctx wait: timeout" in err["message"]
    assert [len(n.record.bodies) for n in c.gen] == [1, 0]  # not handed to another gen server
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)  # and the lease the late ctx answer named is released


def metric(text: str, name: str) -> float:
    """The value of the one sample line starting with ``name`` (labels included) in /metrics."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_a_stream_is_counted_once_and_times_its_kv_handoff_from_the_ctx_answer(make_cluster):
    """The gen stream's POST leaves with the ctx request, so its first byte waited for the whole
    prefill (0.4 s): the KV-transfer histogram times the handoff from the ctx answer instead."""
    c = make_cluster(schedule_style="generation_first", behaviors={"ctx": [{"ctx_delay_s": 0.4}]})
    for stream in (True, False):
        r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=10)
        assert r.status_code == 200, r.text
    text = httpx.get(c.url + "/metrics", timeout=5).text
    assert metric(text, 'pdserve_orchestrator_routed_requests_total{path="disaggregated",pool="gen"}') == 2
    # Both: a non-stream request is streamed internally from the gen server (migration on), so its
    # handoff is timed the same way.
    assert metric(text, "pdserve_orchestrator_kv_transfer_seconds_count") == 2
    assert metric(text, "pdserve_orchestrator_kv_transfer_seconds_sum") < 0.4   # without the 0.4 s prefills
    assert metric(text, "pdserve_orchestrator_ctx_phase_seconds_sum") >= 0.8    # both waited for it


@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_a_stream_gets_the_ctx_token_at_once_not_after_the_gen_servers_pull(make_cluster, path, body, chat):
    """The gen server is slow to its first byte (0.6 s: a long KV pull); the client's first chunk,
    the ctx server's token, comes long before it, and the rest follows once, in order."""
    c = make_cluster(schedule_style="generation_first", behaviors={"gen": [{"answer_delay_s": 0.6}]})
    t_first, raw = None, b""
    with httpx.stream("POST", c.url + path, json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        for piece in r.iter_bytes():
            if t_first is None and b"data: {" in piece:
                t_first = time.monotonic()
            raw += piece
    events = parse_sse(raw)
    (t_gen,) = c.gen[0].record.answered_at  # when the gen server began its answer (after 0.6 s)
    assert t_first is not None and t_first < t_gen
    assert stream_text(events, chat) == text_of(5) and events[-1] == "[DONE]"
    assert len({e["id"] for e in events if isinstance(e, dict)}) == 1  # one stream, one id
    assert "token_ids" not in raw.decode()                              # the extension field is stripped
