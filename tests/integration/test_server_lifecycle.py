"""How a real server ends (tiny model, MPI lattice): every frontend answers every route, a drain
sent to frontend 1 reaches the engine, SIGTERM waits for in-flight work and exits 0, a hung step
makes the engine dead and the server exit 75."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology

TOKEN = "lifecycle-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENV = {"PDSERVE_ADMIN_TOKEN": TOKEN, "PDSERVE_REGISTER": "0"}


@contextlib.contextmanager
def on_frontend(url: str, fid: str, timeout_s: float = 60) -> Iterator[httpx.Client]:
    """A keep-alive connection that the kernel gave to frontend ``fid`` (new connections until one is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with httpx.Client(base_url=url, timeout=10) as c:
            if c.get("/health").headers.get("x-pdserve-frontend") == fid:
                yield c
                return
    raise AssertionError(f"no connection reached frontend {fid} within {timeout_s} s")


@pytest.fixture(scope="module")
def two_frontends(tiny_model_dir, procs, tmp_path_factory) -> tuple[str, str]:
    topo = write_topology(tmp_path_factory.mktemp("topo") / "k2.yaml", str(tiny_model_dir), TINY_NAME,
                          engine={"num_frontends": 2, "drain_grace_s": 60})
    url = Cluster(topo, procs).server_url("gen")
    procs.start("gen-k2", "-m", "gen_worker", "--config", str(topo), "--log-dir", str(procs.log_dir),
                env={**ENV, "PDSERVE_TEST_STEP_DELAY_S": "0.15"})  # a stream of 100 tokens lasts >= 15 s: the drain steps below take seconds on a loaded machine
    procs.wait_healthy("gen-k2", url)
    return "gen-k2", url


def test_every_frontend_serves_the_tokenizer(two_frontends):
    _, url = two_frontends
    answers = {}
    for fid in ("0", "1"):
        with on_frontend(url, fid) as c:
            r = c.get("/tokenizer")
            assert r.status_code == 200 and r.headers["x-pdserve-frontend"] == fid, r.text[:200]
            answers[fid] = r.json()
    assert answers["0"] == answers["1"] and "model" in answers["1"]["tokenizer_json"]


def test_drain_on_frontend_1_reaches_the_engine_and_sigterm_exits_0_after_in_flight_work(two_frontends, procs):
    name, url = two_frontends
    body = {"model": TINY_NAME, "prompt": "once upon a time", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True}
    stream: dict = {"tokens": 0, "finish": None, "errors": []}
    started = threading.Event()

    def consume() -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    stream["errors"].append(data)
                    continue
                if data.get("usage"):
                    stream["tokens"] = data["usage"]["completion_tokens"]
                if data["choices"]:
                    stream["finish"] = data["choices"][0]["finish_reason"] or stream["finish"]
                started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(60)
    with on_frontend(url, "1") as c1, on_frontend(url, "0") as c0:
        assert c1.post("/admin/drain").status_code == 401  # the admin token is needed on every frontend
        r = c1.post("/admin/drain", headers=AUTH)
        assert r.status_code == 200 and r.headers["x-pdserve-frontend"] == "1" and r.json()["state"] == "draining"
        deadline = time.monotonic() + 5  # frontend 0 learns it from rank 0's state push
        while time.monotonic() < deadline and c0.get("/health").status_code == 200:
            time.sleep(0.05)
        h = c0.get("/health")
        assert h.status_code == 503 and "draining" in h.json()["error"]["message"]
        for c in (c0, c1):  # no new request anywhere
            r = c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    assert stream["finish"] is None, "the stream ended before SIGTERM: nothing was in flight"
    proc = procs.procs[name]
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    reader.join(10)
    assert code == 0, procs.log(name)[-2000:]
    assert stream["errors"] == [] and stream["finish"] == "length" and stream["tokens"] == 100, stream
    print(f"SIGTERM -> exit 0 after the in-flight stream finished: {time.monotonic() - t_term:.2f} s")
    procs.procs.pop(name)


def test_a_hung_step_makes_the_engine_dead_and_the_server_exit_75(tiny_model_dir, procs, tmp_path):
    topo = write_topology(tmp_path / "hang.yaml", str(tiny_model_dir), TINY_NAME,
                          engine={"step_timeout_s": 1.0, "dead_exit_grace_s": 1.0})
    url = Cluster(topo, procs).server_url("gen")
    procs.start("gen-hang", "-m", "gen_worker", "--config", str(topo), "--log-dir", str(procs.log_dir),
                env={**ENV, "PDSERVE_TEST_STEP_DELAY_S": "600"})  # the first step never comes back
    procs.wait_healthy("gen-hang", url)
    proc = procs.procs["gen-hang"]
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}, timeout=30)
    t_fail = time.monotonic() - t0
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead", r.text
    assert "step_timeout_s=1 s" in r.json()["error"]["message"]
    assert t_fail < 1.0 * 1.25 + 2.0, t_fail  # the watchdog's bound, plus slack for a loaded machine
    code = proc.wait(30)
    t_exit = time.monotonic() - t0
    assert code == 75, procs.log("gen-hang")[-2000:]
    print(f"hung step: request failed after {t_fail:.2f} s, server exited 75 after {t_exit:.2f} s")
    procs.procs.pop("gen-hang")
