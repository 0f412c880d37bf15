"""A real cluster whose orchestrator launches its own servers (``launcher.kind: local``), tiny model."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.procs import ROOT, free_port

TINY = "tiny-llama"
TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


@dataclass
class LaunchedCluster:
    url: str
    proc: subprocess.Popen
    log_dir: Path

    def status(self) -> dict:
        return httpx.get(f"{self.url}/cluster/status", timeout=5).json()

    def servers(self, pool: str) -> list[dict]:
        return self.status()["pools"][pool]["servers"]

    def scale(self, pool: str, n: int) -> None:
        r = httpx.post(f"{self.url}/cluster/pools/{pool}/scale", json={"instances": n}, headers=AUTH, timeout=5)
        assert r.status_code == 202, r.text

    def settled(self, pool: str, n: int, timeout_s: float = 120) -> list[dict]:
        def ok():
            p = self.status()["pools"][pool]
            done = p["ready"] == n and len(p["servers"]) == n and not p["launching"] and not p["draining"]
            return p["servers"] if done else None

        return wait_for(ok, timeout_s, f"pool {pool} to settle at {n} ready servers\n{self.log()}")

    def log(self) -> str:
        return (self.log_dir / "orchestrator.log").read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def launch_cluster(tmp: Path, doc: dict) -> Iterator[LaunchedCluster]:
    """Write ``doc`` as a topology, start its orchestrator (which launches the servers), wait for its
    ``/health``; at exit SIGTERM it and check that no server it launched outlives it."""
    port = doc["orchestrator"]["port"]
    topo = tmp / "cluster.yaml"
    topo.write_text(yaml.safe_dump(doc))
    (tmp / "logs").mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PDSERVE_ADMIN_TOKEN": TOKEN}
    with open(tmp / "logs" / "orchestrator.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--config", str(topo)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cluster = LaunchedCluster(f"http://127.0.0.1:{port}", proc, tmp / "logs")
    try:
        def healthy():
            assert proc.poll() is None, cluster.log()
            try:
                return httpx.get(cluster.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 180, "the orchestrator's /health")
        yield cluster
    finally:
        pids = [s["pid"] for p in ("ctx", "gen") for s in cluster.servers(p) if s.get("pid")] if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)  # the orchestrator stops the servers it launched
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        for pid in pids:  # none may outlive the orchestrator
            wait_for(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), 15, f"server {pid} to exit")


@pytest.fixture(scope="module", params=["inproc", "mpi"])
def launched(request, tiny_model_dir, tmp_path_factory) -> LaunchedCluster:
    """1 ctx + 1 gen launched by the orchestrator, once per ``engine.executor`` (``mpi`` is the
    default lattice; a test that needs only one narrows it with
    ``@pytest.mark.parametrize("launched", ["inproc"], indirect=True)``)."""
    tmp = tmp_path_factory.mktemp(f"control_plane_{request.param}")
    doc = {
        "model": {"path": str(tiny_model_dir), "name": TINY},
        "engine": {"num_threads": 1, "num_kv_blocks": 512, "block_size": 4, "executor": request.param},
        "orchestrator": {"port": free_port(), "health_interval_s": 0.2, "max_local_prefill_length": 12,
                         "heartbeat_ttl_s": 5, "drain_timeout_s": 60},
        "launcher": {"kind": "local", "log_dir": str(tmp / "logs"), "grace_s": 5, "monitor_interval_s": 0.2},
        "pools": {"ctx": {"router": "kv_cache_aware", "servers": [{"port": 0}], "max_instances": 3},
                  "gen": {"router": "least_loaded", "servers": [{"port": 0}], "max_instances": 3}},
    }
    with launch_cluster(tmp, doc) as cluster:
        yield cluster


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


@dataclass
class Load:
    """A steady stream of requests from the ``openai`` client (stream and non-stream) in threads."""

    url: str
    threads: int = 2
    errors: list[str] = field(default_factory=list)
    done: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> "Load":
        for i in range(self.threads):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _run(self, worker: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"{n} from {worker}: tell me a long story about the sea and the wind and the stars"
            try:
                if n % 2:
                    chunks = client.chat.completions.create(
                        model=TINY, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
                        stream=True)
                    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
                    assert finish[-1] == "length", finish
                else:
                    r = client.completions.create(model=TINY, prompt=prompt, max_tokens=12, temperature=0)
                    assert r.usage.completion_tokens == 12, r.usage
                self.done += 1
            except Exception as err:  # noqa: BLE001 - every failure is a test failure, recorded
                self.errors.append(f"{type(err).__name__}: {err}")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(90)
