"""The relay with fake servers: the ctx server's first token at once, gen retries after it, and
migration of a stream whose gen server breaks mid-decode (stream and non-stream)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from orch_fakes import text_of
from orch_sse import parse_sse, stream_text
from test_orch_flow import COMPLETION, ENDPOINTS


def stream_events(url: str, body: dict) -> tuple[list, float]:
    """(parsed SSE events, time.monotonic() when the first event arrived)."""
    raw, t_first = b"", None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        for piece in r.iter_raw():
            if t_first is None and b"data: " in piece:
                t_first = time.monotonic()
            raw += piece
    return parse_sse(raw), t_first


def first_text(events: list, chat: bool) -> str:
    return stream_text(events[:1], chat)


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_first_token_reaches_the_client_before_the_gen_server_answers(make_cluster, path, body, chat, style):
    c = make_cluster(schedule_style=style)
    c.gen[0].behavior.answer_delay_s = 1.0
    events, t_first = stream_events(c.url + path, body)
    (t_gen,) = c.gen[0].record.answered_at
    assert t_first < t_gen  # sent while the gen phase had not answered yet
    assert first_text(events, chat) == text_of(1)
    if chat:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert stream_text(events, chat) == text_of(5)  # the gen stream's own first token is not sent again
    assert len({e["id"] for e in events if isinstance(e, dict)}) == 1  # one stream, one id


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_gen_failure_after_the_early_first_token_is_retried_without_duplicated_text(make_cluster, path, body, chat,
                                                                                    style):
    c = make_cluster(n_gen=2, schedule_style=style)
    c.gen[0].behavior.fail_status = 503
    events, _ = stream_events(c.url + path, body)
    assert first_text(events, chat) == text_of(1)
    assert stream_text(events, chat) == text_of(5) and events[-1] == "[DONE]"
    lease0, lease1 = (g.record.bodies[0]["disaggregated_params"].get("ctx_request_id") for g in c.gen)
    if style == "context_first":
        assert lease0 == lease1  # the second gen server pulled the same parked KV
    else:  # the first gen request named only the ctx server; the parked lease went to the second
        assert lease0 is None and lease1 in c.ctx[0].record.leases
    assert len(c.ctx[0].record.bodies) == 1


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path,body,chat", ENDPOINTS)
def test_stream_migrates_off_a_gen_server_that_breaks_mid_decode(make_cluster, path, body, chat, stream, style):
    c = make_cluster(n_gen=2, schedule_style=style)
    c.gen[0].behavior.break_after_chunks = 3
    req = {**body, "max_tokens": 6, "stream_options": {"include_usage": True}} if stream else {**body, "max_tokens": 6}
    if stream:
        events, _ = stream_events(c.url + path, req)
        assert stream_text(events, chat) == text_of(6) and events[-1] == "[DONE]"
        assert not any("error" in e for e in events if isinstance(e, dict))
        usage = events[-2]["usage"]
    else:
        r = httpx.post(c.url + path, json=req, timeout=10)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert (answer["choices"][0]["message"]["content"] if chat else answer["choices"][0]["text"]) == text_of(6)
        usage = answer["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == 3
    assert len(c.ctx[0].record.bodies) == 2  # prefilled again for the migration target
    first, again = (g.record.bodies[0]["disaggregated_params"] for g in c.gen)
    assert first["stream_token_ids"] is True
    k = len(again["first_gen_tokens"])
    assert again["first_gen_tokens"] == list(range(k)) and 1 <= k <= 3  # what gen[0] had streamed
    seeds = {json.dumps(b.get("seed")) for n in (*c.ctx, *c.gen) for b in n.record.bodies}
    assert len(seeds) == 1 and seeds != {"null"}  # one seed, fixed by the orchestrator, for every server
    metrics = httpx.get(c.url + "/metrics", timeout=5).text
    assert "pdserve_orchestrator_migrations_total 1.0" in metrics


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
def test_an_in_band_engine_dead_event_migrates_the_stream(make_cluster, style):
    c = make_cluster(n_gen=2, schedule_style=style)
    c.gen[0].behavior.dead_after_chunks = 2
    events, _ = stream_events(c.url + "/v1/completions", {**COMPLETION, "max_tokens": 6})
    assert stream_text(events, chat=False) == text_of(6) and events[-1] == "[DONE]"
    assert c.gen[1].record.bodies[0]["disaggregated_params"]["first_gen_tokens"] == [0, 1]


def test_migration_waits_for_a_ready_gen_server(make_cluster):
    # The only gen server breaks once and is marked unhealthy; the migration waits until the
    # health poll finds it ready again instead of failing at once.
    c = make_cluster(n_gen=1)
    c.gen[0].behavior.break_after_chunks, c.gen[0].behavior.break_times = 3, 1
    events, _ = stream_events(c.url + "/v1/completions", {**COMPLETION, "max_tokens": 6})
    assert stream_text(events, chat=False) == text_of(6) and events[-1] == "[DONE]"
    assert len(c.gen[0].record.bodies) == 2


def test_migration_limit_0_ends_the_stream_with_an_error_event(make_cluster):
    c = make_cluster(n_gen=2, migration_limit=0)
    c.gen[0].behavior.dead_after_chunks = 2
    events, _ = stream_events(c.url + "/v1/completions", {**COMPLETION, "max_tokens": 6})
    assert stream_text(events, chat=False) == text_of(2)
    assert "engine is dead" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert c.gen[1].record.bodies == []


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_moved_stream_continues_on_another_gen_server_that_pulls_its_kv(make_cluster, stream, style):
    """Drain by moving KV: the draining gen server ends the stream with a moved event; the relay sends
    the request to the other gen server with that lease (no second prefill) and the client sees one
    stream with every token once; a non-stream request is streamed internally the same way (both
    schedule styles)."""
    c = make_cluster(n_gen=2, schedule_style=style)
    c.gen[0].behavior.moved_after_chunks = 3
    req = {**COMPLETION, "max_tokens": 6, "stream_options": {"include_usage": True}} if stream else \
        {**COMPLETION, "max_tokens": 6}
    if stream:
        events, _ = stream_events(c.url + "/v1/completions", req)
        assert stream_text(events, chat=False) == text_of(6) and events[-1] == "[DONE]"
        assert not any("error" in e or "moved" in e for e in events if isinstance(e, dict))
        usage = events[-2]["usage"]
    else:
        r = httpx.post(c.url + "/v1/completions", json=req, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text_of(6)
        usage = r.json()["usage"]
    assert usage["completion_tokens"] == 6
    assert len(c.ctx[0].record.bodies) == 1  # no prefill again: the target pulls the moved KV
    first, moved = (g.record.bodies[0]["disaggregated_params"] for g in c.gen)
    assert first["movable"] is True and moved["request_type"] == "generation_only"
    assert ("ctx_url" in first) == (style == "generation_first")
    assert moved["ctx_request_id"].startswith("moved-") and moved["first_gen_tokens"] == [0, 1, 2]
    assert moved["kv_num_tokens"] == 3 + 2 and moved["kv_endpoint"] == "tcp://127.0.0.1:2"
    metrics = httpx.get(c.url + "/metrics", timeout=5).text
    assert "pdserve_orchestrator_kv_moves_total 1.0" in metrics
    assert "pdserve_orchestrator_migrations_total 0.0" in metrics
    status = httpx.get(c.url + "/cluster/status", timeout=5).json()
    assert all(s["state"] == "ready" for s in status["pools"]["gen"]["servers"])  # a drain is not a failure
