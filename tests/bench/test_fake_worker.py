"""bench/fake_worker.py, the overhead bench's workers: in generation_first the gen worker really
waits for the ctx worker's lease signal before it streams, and ``--trace`` stamps every step of a
request under its X-Request-Id."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from bench.fake_worker import MODEL, WORD, FakeWorker
from tests.orchestrator.orch_fakes import ThreadServer


@pytest.fixture
def workers():
    a = ThreadServer(FakeWorker("prefill", "", 0.0, trace=100)).start()
    b = ThreadServer(FakeWorker("decode", "", 0.0, trace=100)).start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


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
    assert sb["gen_in"] <= sb["wait_sent"] < sa["lease_in"] < sa["ctx_in"] < sa["ctx_out"] <= sa["lease_out"]
    assert sa["lease_out"] < sb["wait_back"] <= sb["gen_first"] <= sb["gen_out"]
    stats = httpx.get(b.url + "/stats", timeout=5).json()
    assert stats["waited"] == 1 and stats["phases"] == {"generation_only": 1}


def test_trace_off_keeps_nothing():
    quiet = ThreadServer(FakeWorker("both", "", 0.0)).start()
    try:
        r = httpx.post(quiet.url + "/v1/completions", headers={"X-Request-Id": "rid-2"}, timeout=10,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 200
        assert httpx.get(quiet.url + "/trace", timeout=5).json() == {"steps": {}}
    finally:
        quiet.stop()
