"""The executor lattice with real processes: rank death and start-up failure (K frontends on one port:
test_lattice_frontends.py, a file of its own so the two xdist workers can run both halves at once)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import ROOT, Cluster, write_topology


@pytest.fixture(scope="module")
def two_gen_cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    topo = write_topology(tmp_path_factory.mktemp("topo") / "lattice.yaml", str(tiny_model_dir), TINY_NAME,
                          num_gen=2, engine={"num_frontends": 2,
                                             # the dead server's 503s are asserted below: keep it up
                                             # past the default 0.25 s (a loaded suite took longer)
                                             "dead_exit_grace_s": 30.0})
    return Cluster(topo, procs).start()


def stream_body(max_tokens: int = 2000) -> dict:
    return {"model": TINY_NAME, "prompt": "tell me everything", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def stream_until_end(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> tuple[float, str]:
    """Stream one request; return (monotonic end time, last data line)."""
    last = ""
    async with client.stream("POST", url + "/v1/completions", json=stream_body()) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                started.set()
                if line != "data: [DONE]":
                    last = line
    return time.monotonic(), last


def rank_pids(url: str) -> list[int]:
    return [r["pid"] for r in httpx.get(url + "/server_info", timeout=5).json()["ranks"]]


def test_kill_rank_under_16_streams(two_gen_cluster):
    gen0, orch = two_gen_cluster.server_url("gen", 0), two_gen_cluster.url
    (pid,) = rank_pids(gen0)

    async def scenario():
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.create_task(stream_until_end(c, gen0, started)) for _ in range(16)]
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.sleep(0.3)
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            health = []
            while time.monotonic() - t_kill < 1.0:
                health.append((time.monotonic() - t_kill, (await c.get(gen0 + "/health")).status_code))
                if health[-1][1] == 503:
                    break
                await asyncio.sleep(0.05)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return t_kill, health, results

    t_kill, health, results = asyncio.run(scenario())
    assert health[-1][1] == 503 and health[-1][0] < 1.0, health
    for end, last in results:
        assert end - t_kill < 2.0
        assert "engine is dead" in json.loads(last[6:])["error"]["message"]
    r = httpx.get(gen0 + "/health", timeout=5)
    assert r.status_code == 503 and "rank 0" in r.json()["error"]["message"]
    # New requests are refused at once, and the orchestrator routes around the dead server.
    r = httpx.post(gen0 + "/v1/completions", json={**stream_body(4), "stream": False}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead"
    time.sleep(1.0)  # a health poll interval or two
    for _ in range(6):
        r = httpx.post(orch + "/v1/completions", json={**stream_body(4), "stream": False}, timeout=30)
        assert r.status_code == 200, r.text


def test_rank_crash_during_startup_is_a_startup_error(tiny_model_dir, tmp_path):
    topo = write_topology(tmp_path / "crash.yaml", str(tiny_model_dir), TINY_NAME,
                          engine={"worker_start_timeout_s": 60})
    env = {**os.environ, "PDSERVE_TEST_CRASH_RANK": "0", "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gen_worker", "--config", str(topo), "--log-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 3, p.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert "worker rank 0 failed during start-up: RuntimeError: injected start-up crash" in p.stderr
    assert str(tmp_path / "gen0.ranks.log") in p.stderr
    assert "engine is dead" not in p.stderr
