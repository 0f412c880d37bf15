"""Chaos (issue 14 part 5), tiny model: 2 ctx + 2 gen servers on the default MPI lattice, launched
and restarted by the orchestrator's local launcher (``max_restarts: 3``), under a bounded number of
streaming greedy chat requests at concurrency 8, with ``kill -9`` of a gen server's rank 0, a ctx
server's frontend and the other gen server's frontend at fixed times (bench/_chaos.py runs it).

It asserts: no request hung (each ended within :data:`REQUEST_BOUND_S`), every killed server was
replaced and the orchestrator shows all four ready, every KV pool is back to full (free blocks ==
total, no parked lease), and at least :data:`MIN_IDENTICAL_FRACTION` of the requests completed with
the text of an undisturbed greedy run (the issue's 95 %): a stream whose gen server dies migrates
to the other gen server (issue 14 part 2) and continues with the same text.
"""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from bench._chaos import (ChaosLoad, Kill, plan_victims, reference_texts, run_chaos, tally, wait_all_ready,
                          wait_kv_full)
from tests.control_plane.conftest import TINY, launch_cluster
from tests.integration.procs import free_port

MAX_REQUESTS = 1500              # the load stops TAIL_S after the last replacement is ready, or here
CONCURRENCY = 8
INTERVAL_S = 0.1                 # request starts at least this far apart
MAX_TOKENS = 32
REQUEST_BOUND_S = 30.0           # a request still open after this is hung
# The second gen kill waits for the first one's replacement (+ 1 s): with both gen servers down at
# once every request fails at once, which measures the machine's load, not the cluster.
KILLS = [Kill(1.5, "gen", 0, "rank0"), Kill(3.0, "ctx", 0, "frontend"),
         Kill(4.5, "gen", 1, "frontend", after_replacement_of=0)]
REPLACEMENT_WATCH_S = 90.0       # how long each kill's watcher waits for the replacement
TAIL_S = 2.0
# With stream migration the streams of a killed gen server continue on the other one; what may still
# fail is a request that finds no ready ctx server in the moment of the ctx kill (load 8-27 on
# 2026-12-02: 359 of 359 identical in one run).
MIN_IDENTICAL_FRACTION = 0.95
LEASE_MS = 3000                  # a lease orphaned by a dead gen server is freed within this

PROMPTS = [f"Question {i}: tell me a long story about the {w} and the sea, please, with many details"
           for i, w in enumerate(["wind", "stars", "moon", "rain", "ships", "birds", "sand", "storm"])]


@pytest.fixture(scope="module")
def chaos_cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    doc = {
        "model": {"path": str(tiny_model_dir), "name": TINY},
        "engine": {"num_threads": 1, "num_kv_blocks": 256, "block_size": 4, "dtype": "float32", "executor": "mpi",
                   "dead_exit_grace_s": 1.0},
        "kv_transfer": {"lease_ms": LEASE_MS, "timeout_ms": 5000},
        "orchestrator": {"port": free_port(), "health_interval_s": 0.2, "heartbeat_ttl_s": 5},
        "launcher": {"kind": "local", "log_dir": str(tmp / "logs"), "grace_s": 5, "monitor_interval_s": 0.2},
        "pools": {p: {"servers": [{"port": 0}, {"port": 0}], "max_restarts": 3} for p in ("ctx", "gen")},
    }
    with launch_cluster(tmp, doc) as cluster:
        yield cluster


def test_chaos_three_kills_under_streaming_load(chaos_cluster):
    c = chaos_cluster
    wait_all_ready(c.url, {"ctx": 2, "gen": 2}, timeout_s=120)
    refs = asyncio.run(reference_texts(c.url, TINY, PROMPTS, MAX_TOKENS, CONCURRENCY, REQUEST_BOUND_S))
    records = plan_victims(c.url, KILLS)
    load = ChaosLoad(c.url, TINY, PROMPTS, MAX_REQUESTS, CONCURRENCY, MAX_TOKENS, REQUEST_BOUND_S, INTERVAL_S)
    outcomes = asyncio.run(run_chaos(load, records, REPLACEMENT_WATCH_S, TAIL_S))
    counts = tally(outcomes, refs)
    last_end = max(o.elapsed_s for o in outcomes)
    print(f"\nchaos (tiny): {counts}; load ran {load.duration_s:.1f} s; kills (what, pool, at s, replacement ready "
          f"after s) {[(r.kill.target, r.kill.pool, r.t_kill_s, r.ready_after_s) for r in records]}; "
          f"load average {os.getloadavg()[0]:.1f}")

    # The load was still on when the last kill fired (a cap reached earlier would test nothing).
    assert all(r.t_kill_s is not None and r.t_kill_s < load.duration_s for r in records), (load.duration_s, records)
    assert counts["hung"] == 0, counts
    assert last_end < REQUEST_BOUND_S, last_end
    for r in records:  # every kill fired and its server was replaced (a new pid at its address, ready)
        assert r.t_kill_s is not None and r.ready_after_s is not None, (r, c.log())
    status = wait_all_ready(c.url, {"ctx": 2, "gen": 2}, timeout_s=30)
    assert status["pools"]["gen"]["restarts"] == 2 and status["pools"]["ctx"]["restarts"] == 1, status
    # The rank-0 kill made its server exit 75 (dead engine), and the launcher restarted it for that
    # (the frontend kills are signal deaths); test_restart.py checks the same for a TP follower rank.
    full_log = (c.log_dir / "orchestrator.log").read_text(errors="replace")
    dead_exits = re.findall(r"(\w+)#\d+ \S+ died \(exit code 75 \(engine dead\)\); restart 1 of 3", full_log)
    assert dead_exits == ["gen"], (dead_exits, c.log())
    pools = wait_kv_full(status, timeout_s=LEASE_MS / 1000 + 10)
    assert all(free == total and parked == 0 for free, total, parked in pools.values()), pools
    assert counts["identical"] >= MIN_IDENTICAL_FRACTION * counts["requests"], counts
    assert counts["identical"] == counts["completed"], counts  # a completed stream is never wrong
