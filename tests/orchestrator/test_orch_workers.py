"""``orchestrator.num_workers: 2``: two real orchestrator processes on one port, in front of fake
ctx/gen servers running in this process. Which process answered is read from the
``x-pdserve-orchestrator-worker`` header (0 = the owner); every request opens a new connection, so
the kernel's SO_REUSEPORT choice is drawn afresh each time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from orch_fakes import MODEL, Behavior, Record, ThreadServer, bind_socket, make_fake_server, text_of
from conftest import make_topology
from orchestrator.control import processes_line

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADER = "x-pdserve-orchestrator-worker"
MAX_TRIES = 80  # fresh connections until each process answered once (a miss is ~2^-80 at 50/50)


class Group:
    """Fake ctx + gen servers (threads here) and one orchestrator process group (a subprocess)."""

    def __init__(self, tmp: Path) -> None:
        self.ctx_beh, self.gen_beh, self.ctx_rec, self.gen_rec = Behavior(), Behavior(), Record(), Record()
        self.fakes = [ThreadServer(make_fake_server("ctx", self.ctx_beh, self.ctx_rec)).start(),
                      ThreadServer(make_fake_server("gen", self.gen_beh, self.gen_rec)).start()]
        sock = bind_socket()
        port = sock.getsockname()[1]
        sock.close()
        topo = make_topology([self.fakes[0].port], [self.fakes[1].port], port, num_workers=2,
                             health_interval_s=0.2, worker_feed_interval_s=0.05)
        path = tmp / "topology.yaml"
        path.write_text(yaml.safe_dump(topo.model_dump(mode="json")))
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(tmp / "orchestrator.log", "wb")
        env = {**os.environ, "PDSERVE_ADMIN_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
        # Its own session: stop() can end the whole group (the owner and the worker process it
        # started) by the owner's PID, even after a SIGKILL of the owner.
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--config", str(path), "--log-level",
                                      "warning"], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self.wait_both(60.0)
        except BaseException:
            # The fixture never gets this object when the constructor raises, so nobody else would
            # stop the processes and fake servers started above (they were left running).
            self.stop()
            raise

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, trust_env=False, **kw)  # a new connection each call

    def status(self) -> dict:
        return self.get("/cluster/status").json()

    def worker_pid(self) -> int:
        return next(p["pid"] for p in self.status()["processes"] if p["index"] == 1)

    def wait_both(self, timeout_s: float) -> None:
        """Until /health is 200 and the worker has reported to the owner (then it serves too)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {self.proc.returncode}")
            try:
                if self.get("/health").status_code == 200:
                    procs = self.status()["processes"]
                    if all(p["alive"] and p.get("report_age_s", 9) < 1 for p in procs if p["index"]):
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("orchestrator group not ready")

    def from_each(self, call) -> dict[str, httpx.Response]:
        """``call()`` on fresh connections until both processes answered; index -> its answer."""
        seen: dict[str, httpx.Response] = {}
        for _ in range(MAX_TRIES):
            resp = call()
            seen.setdefault(resp.headers[HEADER], resp)
            if len(seen) == 2:
                return seen
        raise AssertionError(f"only processes {sorted(seen)} answered in {MAX_TRIES} connections")

    def stop(self) -> None:
        """Stop the orchestrator group (SIGTERM to the owner, which stops its worker; past 20 s
        SIGKILL to the owner's process group) and the fake servers. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of the group is left (the worker, if the owner could not stop it)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.log.close()
        for fake in self.fakes:
            fake.stop()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    g = Group(tmp_path_factory.mktemp("orch-workers"))
    yield g
    g.stop()


def _complete(url: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10, trust_env=False)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_both_processes_serve_requests_and_metrics_is_their_sum(group):
    by_process: dict[str, int] = {}
    n = 40
    for _ in range(n):
        resp = _complete(group.url)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == text_of(4)
        by_process[resp.headers[HEADER]] = by_process.get(resp.headers[HEADER], 0) + 1
    assert set(by_process) == {"0", "1"}, by_process
    scrapes = group.from_each(lambda: group.get("/metrics"))
    name, labels = "pdserve_orchestrator_requests_total", '{endpoint="/v1/chat/completions",status="200"}'
    for scrape in scrapes.values():  # both answers are the owner's sum over both processes
        assert _metric(scrape.text, name, labels) == n
        assert _metric(scrape.text, "pdserve_orchestrator_processes") == 2
        assert _metric(scrape.text, "pdserve_orchestrator_e2e_latency_seconds_count",
                       '{endpoint="/v1/chat/completions"}') == n


def test_control_routes_work_from_either_process(group):
    owner_pids = set()
    statuses = group.from_each(lambda: group.get("/cluster/status"))
    for resp in statuses.values():
        procs = resp.json()["processes"]
        assert [p["index"] for p in procs] == [0, 1] and all(p["alive"] for p in procs)
        owner_pids.add(procs[0]["pid"])
    assert owner_pids == {group.proc.pid}  # the owner answers for both
    line = processes_line(resp.json())  # what `pdserve status` prints under its table
    assert line is not None and f"0 owner pid {group.proc.pid}; 1 worker pid {group.worker_pid()}" in line
    ctx_url = group.fakes[0].url
    reg = {"role": "ctx", "url": ctx_url, "model": MODEL, "state": "serving"}
    for resp in group.from_each(lambda: httpx.post(group.url + "/cluster/workers", json=reg, headers=AUTH,
                                                    timeout=10, trust_env=False)).values():
        assert resp.status_code == 200 and resp.json()["name"] == "ctx[0]", resp.text
    for resp in group.from_each(lambda: httpx.delete(group.url + "/cluster/workers", params={"url": "http://x:1"},
                                                      headers=AUTH, timeout=10, trust_env=False)).values():
        assert resp.status_code == 404 and "http://x:1" in resp.text  # the query string travelled
    for resp in group.from_each(lambda: httpx.post(group.url + "/cluster/pools/gen/scale", json={"instances": 1},
                                                    timeout=10, trust_env=False)).values():
        assert resp.status_code == 401  # no token: refused by the owner's admin check
    for resp in group.from_each(lambda: httpx.post(group.url + "/cluster/pools/gen/scale", json={"instances": 1},
                                                    headers=AUTH, timeout=10, trust_env=False)).values():
        assert resp.status_code == 409 and "external" in resp.text
    before = len(group.ctx_rec.prefix_resets) + len(group.gen_rec.prefix_resets)
    for resp in group.from_each(lambda: httpx.post(group.url + "/reset_prefix_cache", headers=AUTH,
                                                    timeout=10, trust_env=False)).values():
        assert resp.status_code == 200 and set(resp.json()["servers"]) == {f.url for f in group.fakes}
    assert len(group.ctx_rec.prefix_resets) + len(group.gen_rec.prefix_resets) >= before + 4
    for path in ("/health", "/v1/models"):
        assert {r.status_code for r in group.from_each(lambda: group.get(path)).values()} == {200}


def _stream(url: str, out: dict, key: int) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 12, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20, trust_env=False) as resp:
            out[key] = {"process": resp.headers[HEADER], "status": resp.status_code}
            out[key]["body"] = b"".join(resp.iter_bytes())
    except httpx.HTTPError as err:
        out.setdefault(key, {"process": None})["error"] = repr(err)


def _stream_text(body: bytes) -> str:
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ") and line != b"data: [DONE]"]
    return "".join(json.loads(e)["choices"][0].get("text", "") for e in events if json.loads(e).get("choices"))


def test_killing_a_worker_loses_only_its_requests_and_it_comes_back(group):
    group.gen_beh.chunk_delay_s = 0.15  # ~1.8 s streams: in flight when the worker dies
    try:
        out: dict[int, dict] = {}
        threads = []
        for i in range(10):
            t = threading.Thread(target=_stream, args=(group.url, out, i), daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + 10
        while len(out) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.02)  # every stream has its head: each one is on a known process
        old_pid = group.worker_pid()
        os.kill(old_pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
    finally:
        group.gen_beh.chunk_delay_s = 0.0
    on_owner = [o for o in out.values() if o["process"] == "0"]
    on_worker = [o for o in out.values() if o["process"] == "1"]
    assert on_owner and on_worker, out  # 10 streams over 2 processes: both got some (~2^-9 to miss)
    for o in on_owner:  # not one request the owner held was lost
        assert o["status"] == 200 and "error" not in o, o
        assert o["body"].endswith(b"data: [DONE]\n\n") and _stream_text(o["body"]) == text_of(12), o
    assert any("error" in o for o in on_worker), on_worker  # the killed process's streams broke
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        procs = {p["index"]: p for p in group.status()["processes"]}
        if procs[1]["alive"] and procs[1]["pid"] != old_pid and procs[1]["restarts"] == 1 \
                and procs[1].get("report_age_s", 9) < 1:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"worker 1 did not come back: {group.status()['processes']}")
    answers = group.from_each(lambda: _complete(group.url))
    assert {r.status_code for r in answers.values()} == {200}


def test_owner_death_stops_the_workers_within_seconds(group):
    """Last in this file: it ends the module's group (the fixture's stop then finds it gone)."""
    worker = group.worker_pid()
    assert _alive(worker)
    group.proc.kill()
    group.proc.wait(5)
    t0 = time.monotonic()
    while _alive(worker) and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    gone_after_s = time.monotonic() - t0
    assert not _alive(worker), "the worker outlived its owner by 15 s"
    print(f"worker gone {gone_after_s:.2f} s after the owner")
    assert gone_after_s < 8, gone_after_s
    with pytest.raises(httpx.ConnectError):  # nobody is left on the port
        group.get("/health")
