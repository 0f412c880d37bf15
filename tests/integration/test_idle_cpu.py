"""A server whose engine has work it cannot schedule sits idle instead of spinning (issue 14.7).

A ctx server with a tiny KV cache parks one ``context_only`` request's blocks under a long lease;
a colocated request then waits for blocks while nothing runs. Before the fix the engine loop
polled with a zero timeout and stepped the engine as fast as it could (a whole core, competing
for the GIL with the threads that free blocks); now it waits for a command or a post. The server
(its HTTP process and, in the lattice, its worker ranks) must use under 5% of a core over 2 s, and the waiting request must run as
soon as the lease is released (a post from the lease path wakes the loop).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology

BLOCKS, BLOCK_SIZE = 16, 4   # 64 tokens of KV in all
MEASURE_S = 2.0
MAX_CORE_SHARE = 0.05


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (``/proc/PID/stat`` fields 14 and 15; proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(url: str, frontend_pid: int) -> list[int]:
    """The frontend and, in the lattice, every worker rank."""
    info = httpx.get(url + "/server_info", timeout=5).json()
    return [frontend_pid, *(r["pid"] for r in info.get("ranks", []))]


@pytest.mark.parametrize("executor", ["inproc", "mpi"])
def test_a_server_waiting_for_blocks_stays_idle(executor, tiny_model_dir, procs, tmp_path_factory):
    topo = write_topology(tmp_path_factory.mktemp("topo") / "idle.yaml", str(tiny_model_dir), TINY_NAME,
                          engine={"num_kv_blocks": BLOCKS, "block_size": BLOCK_SIZE, "executor": executor,
                                  "max_model_len": BLOCKS * BLOCK_SIZE},
                          kv_transfer={"lease_ms": 60_000})
    url = Cluster(topo, procs).server_url("ctx")
    name = f"ctx-idle-{executor}"
    proc = procs.start(name, "-m", "ctx_worker", "--config", str(topo), "--log-dir", str(procs.log_dir))
    try:
        procs.wait_healthy(name, url)
        parked = {"model": TINY_NAME, "prompt": list(range(5, 45)), "max_tokens": 4, "temperature": 0,
                  "ignore_eos": True, "disaggregated_params": {"request_type": "context_only"}}
        r = httpx.post(url + "/v1/completions", json=parked, timeout=30)
        assert r.status_code == 200, r.text
        ctx_request_id = r.json()["choices"][0]["disaggregated_params"]["ctx_request_id"]  # 10 of 16 blocks parked
        waiting: dict = {}
        # needs 9 blocks and shares no prefix with the parked prompt (a prefix-cache hit would let
        # it run at once): waits until the lease is released
        body = {"model": TINY_NAME, "prompt": list(range(100, 132)), "max_tokens": 2, "temperature": 0,
                "ignore_eos": True}
        t = threading.Thread(target=lambda: waiting.update(
            r=httpx.post(url + "/v1/completions", json=body, timeout=60)), daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/server_info", timeout=5).json().get("waiting_requests") != 1:
            assert time.monotonic() < deadline, "the second request never reached the waiting queue"
            time.sleep(0.1)
        pids = server_pids(url, proc.pid)
        time.sleep(0.3)
        before, t0 = sum(cpu_seconds(p) for p in pids), time.monotonic()
        time.sleep(MEASURE_S)
        share = (sum(cpu_seconds(p) for p in pids) - before) / (time.monotonic() - t0)
        print(f"{executor}: {share:.2%} of a core over {MEASURE_S:g} s while waiting for blocks")
        assert share < MAX_CORE_SHARE, f"{executor}: {share:.1%} of a core while waiting for blocks (pids {pids})"
        assert t.is_alive(), "the waiting request finished although its blocks were never free"
        t1 = time.monotonic()
        r = httpx.post(url + "/disagg/release", json={"ctx_request_id": ctx_request_id}, timeout=5)
        assert r.json() == {"released": True}
        t.join(30)
        assert waiting["r"].status_code == 200, waiting["r"].text
        assert waiting["r"].json()["usage"]["completion_tokens"] == 2
        assert time.monotonic() - t1 < 5, "the waiting request did not run soon after the release"
    finally:
        procs.stop(name)
