"""bench/fake_worker.py, the overhead bench's workers: in generation_first the gen worker really
waits for the ctx worker's lease signal before it streams, and ``--trace`` stamps every step of a
request under its X-Request-Id."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from bench.fake_worker import MODEL, WORD, FakeWorker, _token_events
from tests.orchestrator.orch_fakes import ThreadServer


@pytest.fixture(params=["pull", "push"])
def workers(request):
    a = ThreadServer(FakeWorker("prefill", "", 0.0, trace=100, ctx_signal=request.param)).start()
    b = ThreadServer(FakeWorker("decode", "", 0.0, trace=100, ctx_signal=request.param)).start()
    try:
        yield a, b
    finally:
        b.stop()  # first: its lifespan closes the subscription a would otherwise wait for
        a.stop()


def _events(raw: bytes) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in raw.split(b"\n\n") if line.startswith(b"data: ")]


def test_gen_worker_streams_only_after_the_ctx_worker_answered(workers):
    a, b = workers
    did, headers = "disagg-fake-1", {"X-Request-Id": "rid-1"}
    gen_body = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True,
                "disaggregated_params": {"request_type": "generation_only", "disagg_request_id": did,
                                         "ctx_url": a.url}}
    done: dict = {}

    def gen() -> None:
        done["response"] = httpx.post(b.url + "/v1/completions", json=gen_body, headers=headers, timeout=10)
        done["t"] = time.monotonic()

    thread = threading.Thread(target=gen)
    thread.start()
    time.sleep(0.3)
    assert "response" not in done  # no ctx answer yet: the gen worker is still waiting
    t_ctx = time.monotonic()
    ctx = httpx.post(a.url + "/v1/completions", headers=headers, timeout=10, json={
        "model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": False,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}})
    assert ctx.status_code == 200 and ctx.json()["choices"][0]["disaggregated_params"]["ctx_request_id"]
    thread.join(10)
    r = done["response"]
    assert r.status_code == 200 and done["t"] > t_ctx
    events = _events(r.content)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == WORD * 4
    assert events[-1] == "[DONE]"
    sa = httpx.get(a.url + "/trace", timeout=5).json()["steps"]["rid-1"]
    sb = httpx.get(b.url + "/trace", timeout=5).json()["steps"]["rid-1"]
    assert sb["gen_in"] <= sb["wait_sent"] < sa["ctx_in"] < sa["ctx_out"] < sb["wait_back"] <= sb["gen_first"]
    assert sb["gen_first"] <= sb["gen_out"]
    if b.server.config.app.ctx_signal == "pull":  # the waiting pull on the ctx worker's lease endpoint
        assert sb["wait_sent"] < sa["lease_in"] < sa["ctx_in"] and sa["ctx_out"] <= sa["lease_out"] < sb["wait_back"]
    else:  # the pushed line: no lease request
        assert "lease_in" not in sa
    stats = httpx.get(b.url + "/stats", timeout=5).json()
    assert stats["waited"] == 1 and stats["phases"] == {"generation_only": 1}


def test_push_replays_what_was_parked_before_the_subscription():
    """A ctx answer made before the gen worker subscribed (its first request) is not lost."""
    a = ThreadServer(FakeWorker("prefill", "", 0.0)).start()
    b = ThreadServer(FakeWorker("decode", "", 0.0)).start()
    try:
        for did in ("early-1", "early-2"):
            r = httpx.post(a.url + "/v1/completions", timeout=10, json={
                "model": MODEL, "prompt": "x", "max_tokens": 3,
                "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}})
            assert r.status_code == 200
        for did in ("early-2", "early-1"):
            r = httpx.post(b.url + "/v1/completions", timeout=10, json={
                "model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
                "disaggregated_params": {"request_type": "generation_only", "disagg_request_id": did,
                                         "ctx_url": a.url}})
            assert r.status_code == 200 and _events(r.content)[-1] == "[DONE]"
        assert httpx.get(b.url + "/stats", timeout=5).json()["waited"] == 2
    finally:
        b.stop()
        a.stop()


def test_trace_off_keeps_nothing():
    quiet = ThreadServer(FakeWorker("both", "", 0.0)).start()
    try:
        r = httpx.post(quiet.url + "/v1/completions", headers={"X-Request-Id": "rid-2"}, timeout=10,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 200
        assert httpx.get(quiet.url + "/trace", timeout=5).json() == {"steps": {}}
    finally:
        quiet.stop()


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_streamed_events_are_each_tokens_chunk(n):
    events = _events(b"".join(_token_events("cmpl-x", "chat.completion.chunk", 7, True, n)))
    assert len(events) == n and all(e["id"] == "cmpl-x" and e["created"] == 7 for e in events)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": WORD} and all(d == {"content": WORD} for d in deltas[1:])
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (n - 1) + ["length"]


@pytest.mark.parametrize("one_write", [False, True])
def test_a_stream_is_the_same_events_in_one_write_or_one_per_event(one_write):
    """--stream-writes one changes how the bytes are written, not which; relay_head gets pass-through events."""
    b = ThreadServer(FakeWorker("decode", "", 0.0, one_write=one_write)).start()
    try:
        plain = httpx.post(b.url + "/v1/completions", timeout=10, json={
            "model": MODEL, "prompt": "a b", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
        head = {"id": "cmpl-orch", "created": 7}
        passed = httpx.post(b.url + "/v1/completions", timeout=10, json={
            "model": MODEL, "prompt": "a b", "max_tokens": 3, "stream": True,
            "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": "c", "relay_head": head}})
    finally:
        b.stop()
    events = _events(plain.content)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]) == WORD * 3
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-1] == "[DONE]"
    records = [json.loads(line[4:]) for line in passed.content.split(b"\n") if line.startswith(b":pd ")]
    assert records == [[0, 4, [1000], None], [4, 8, [1001], None], [8, 12, [1002], "length"]]
    data = [json.loads(line[6:]) for line in passed.content.split(b"\n") if line.startswith(b"data: {")]
    assert len(data) == 3 and {e["id"] for e in data} == {"cmpl-orch"}
