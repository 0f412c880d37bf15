"""Overload and identity at the orchestrator: X-Request-Id end to end (servers, echo, log lines),
429 + Retry-After past max_inflight_requests, session affinity (body limits: tests/fuzz)."""

from __future__ import annotations

import logging
import threading

import httpx

from pdserve.request_id import RequestIdFilter
from test_orch_flow import CHAT, COMPLETION
from test_orch_validation import assert_openai_error


def test_client_request_id_reaches_both_servers_and_is_echoed(cluster):
    for body in ({**COMPLETION, "stream": True}, COMPLETION):
        r = httpx.post(cluster.url + "/v1/completions", json=body, headers={"X-Request-Id": "rid-42"}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "rid-42"
    assert cluster.ctx[0].record.request_ids == ["rid-42", "rid-42"]
    assert cluster.gen[0].record.request_ids == ["rid-42", "rid-42"]


def test_request_id_made_when_missing_or_unsafe(cluster):
    ids = []
    for headers in ({}, {"X-Request-Id": "has spaces"}, {"X-Request-Id": "x" * 129}):
        r = httpx.post(cluster.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        ids.append(r.headers["x-request-id"])
    assert all(i.startswith("req-") for i in ids) and len(set(ids)) == 3
    assert cluster.ctx[0].record.request_ids == ids and cluster.gen[0].record.request_ids == ids
    bad = httpx.post(cluster.url + "/v1/completions", content=b"{", headers={"X-Request-Id": "rid-bad"}, timeout=10)
    assert_openai_error(bad, 400)
    assert bad.headers["x-request-id"] == "rid-bad"  # errors carry it too


def test_log_lines_of_a_request_name_its_id(make_cluster, caplog):
    c = make_cluster(behaviors={"gen": [{"break_after_chunks": 1}]})
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        r = httpx.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True},
                       headers={"X-Request-Id": "rid-log"}, timeout=10)
    assert r.status_code == 200 and "broke" in r.text
    broke = [rec for rec in caplog.records if "broke" in rec.getMessage()]
    assert broke and all(rec.request_id == "rid-log" for rec in broke)


def test_past_max_inflight_requests_429_with_retry_after(make_cluster):
    c = make_cluster(behaviors={"gen": [{"chunk_delay_s": 0.5}]}, max_inflight_requests=2, retry_after_s=3)
    opened, release = threading.Barrier(3), threading.Event()
    results: list[int] = []

    def hold_a_stream() -> None:
        with httpx.stream("POST", c.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10) as r:
            chunks = r.iter_bytes()  # kept: dropping the iterator would close the stream
            next(chunks)  # the request is in flight: its first bytes came
            opened.wait(5)
            release.wait(5)
            results.append(r.status_code if b"[DONE]" in b"".join(chunks) else -1)

    threads = [threading.Thread(target=hold_a_stream) for _ in range(2)]
    for t in threads:
        t.start()
    opened.wait(5)
    try:
        r = httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10)
        err = assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "3" and err["type"] == "rate_limit_error"
        assert "max_inflight_requests" in err["message"]
    finally:
        release.set()
        for t in threads:
            t.join(10)
    assert results == [200, 200]
    assert httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200  # room again
    metrics = httpx.get(c.url + "/metrics", timeout=5).text
    assert 'pdserve_orchestrator_errors_total{kind="overloaded"} 1.0' in metrics


def _servers_used(c, role: str) -> list[int]:
    return [len(n.record.bodies) for n in getattr(c, role)]


def test_session_affinity_on_a_header(make_cluster):
    c = make_cluster(n_ctx=2, n_gen=2, session_affinity="header")
    for _ in range(4):
        r = httpx.post(c.url + "/v1/completions", json=COMPLETION, headers={"X-Session-Id": "s-1"}, timeout=10)
        assert r.status_code == 200, r.text
    assert sorted(_servers_used(c, "ctx")) == [0, 4] and sorted(_servers_used(c, "gen")) == [0, 4]
    for _ in range(4):  # no session: round robin spreads again
        assert httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    assert sorted(_servers_used(c, "ctx")) == [2, 6]


def test_session_affinity_on_the_user_field(make_cluster):
    c = make_cluster(n_ctx=2, n_gen=2, session_affinity="user")
    for user in ("alice", "bob", "alice", "bob", "alice", "bob"):
        r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "user": user}, timeout=10)
        assert r.status_code == 200, r.text
    for role in ("ctx", "gen"):
        users = [[b.get("user") for b in n.record.bodies] for n in getattr(c, role)]
        assert sorted(set(u) for u in users) == [{"alice"}, {"bob"}], users
