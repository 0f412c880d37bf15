"""``engine.cpu_bind`` reaches the worker rank: its threads' affinity, read from /proc, is what was
asked, and greedy output is the same pinned and unpinned (a core outside the process's mask:
tests/executor/test_rank_threads.py)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology

ENV = {"PDSERVE_REGISTER": "0"}
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs cores 0 and 1")


@pytest.fixture(scope="module")
def servers(tiny_model_dir, procs, tmp_path_factory) -> dict[str, str]:
    """Two standalone gen servers with 2 torch threads: cpu_bind '0-1' and 'off'; their URLs."""
    urls = {}
    for bind in ("0-1", "off"):
        topo = write_topology(tmp_path_factory.mktemp("bind") / "t.yaml", str(tiny_model_dir), TINY_NAME,
                              engine={"num_threads": 2, "cpu_bind": bind})
        urls[bind] = Cluster(topo, procs).server_url("gen")
        procs.start(f"gen-{bind}", "-m", "gen_worker", "--config", str(topo), "--log-dir", str(procs.log_dir), env=ENV)
    for bind, url in urls.items():
        procs.wait_healthy(f"gen-{bind}", url)
    return urls


def rank_threads(url: str) -> tuple[int, dict[int, tuple[str, str]]]:
    """Rank 0's pid and each of its threads: tid → (name, Cpus_allowed_list)."""
    (pid,) = [r["pid"] for r in httpx.get(url + "/server_info", timeout=10).json()["ranks"]]
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        allowed = next(ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
        out[int(task.name)] = ((task / "comm").read_text().strip(), allowed)
    return pid, out


def test_the_rank_threads_run_where_cpu_bind_says(servers):
    pid, threads = rank_threads(servers["0-1"])
    assert threads[pid][1] == "0", threads  # the engine thread (the OpenMP master)
    assert [t for t, (_, allowed) in threads.items() if allowed == "1"], threads  # the OpenMP worker
    zmq_io = [allowed for name, allowed in threads.values() if name.startswith("ZMQbg/IO")]
    assert zmq_io and set(zmq_io) == {"0-1"}, threads  # helper threads keep the whole mask
    pid, threads = rank_threads(servers["off"])
    assert {allowed for _, allowed in threads.values()} == {"0-1"}, threads


def test_greedy_output_is_the_same_pinned_and_unpinned(servers):
    body = {"model": TINY_NAME, "prompt": "the pinned threads", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = {bind: httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
             for bind, url in servers.items()}
    assert texts["0-1"] == texts["off"] and texts["off"], texts
