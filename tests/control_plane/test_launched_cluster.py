"""Acceptance checks of the control plane on real processes (tiny model, `launcher.kind: local`).

The tests share one cluster per ``engine.executor`` and run in file order: scaling under load,
prefix affinity, kill -9 under load, conditional disaggregation, metrics. Scaling (with its drains)
runs on the default MPI lattice only (the acceptance line of issue 14 part 5; the launcher, the
drains and the membership are the same code for ``inproc``, so a second run covered nothing new);
conditional disaggregation, metrics and the admin token on both executors; prefix affinity
(routing only) and kill -9 of a ctx server (tests/control_plane/test_restart.py and test_chaos.py
kill on the MPI lattice) only on ``inproc``, to keep the suite's time in check.
"""

from __future__ import annotations

import os
import signal
import time

import httpx

import pytest

from tests.control_plane.conftest import AUTH, TINY, Load, wait_for

INPROC_ONLY = pytest.mark.parametrize("launched", ["inproc"], indirect=True)
MPI_ONLY = pytest.mark.parametrize("launched", ["mpi"], indirect=True)


def served(cluster, pool: str) -> dict[str, int]:
    return {s["url"]: s["served"] for s in cluster.servers(pool)}


@MPI_ONLY
def test_scale_gen_1_3_1_and_ctx_1_2_1_under_load(launched):
    c = launched
    with Load(c.url, threads=2) as load:
        wait_for(lambda: load.done >= 4, 60, "the first requests")
        for pool, sizes in (("gen", (3, 1)), ("ctx", (2, 1))):
            before = set(served(c, pool))
            c.scale(pool, sizes[0])
            t0 = time.monotonic()
            c.settled(pool, sizes[0])
            new = set(served(c, pool)) - before
            assert len(new) == sizes[0] - 1
            # the new servers take traffic within seconds of joining
            wait_for(lambda: all(served(c, pool)[u] > 0 for u in new), 15, f"new {pool} servers to take traffic")
            print(f"{pool} 1 -> {sizes[0]}: settled and serving in {time.monotonic() - t0:.1f} s")
            c.scale(pool, sizes[1])
            c.settled(pool, sizes[1])
        done_before_stop = load.done
    assert load.errors == [], load.errors[:5]
    assert done_before_stop >= 20, done_before_stop
    status = c.status()
    assert status["pools"]["gen"]["target"] == 1 and status["pools"]["ctx"]["target"] == 1


@INPROC_ONLY
def test_kv_cache_aware_routes_shared_prefix_to_one_ctx_server(launched):
    c = launched
    c.scale("ctx", 2)
    c.settled("ctx", 2)
    prefix = "You are a helpful assistant. " * 8
    before = served(c, "ctx")
    for i in range(6):
        r = httpx.post(c.url + "/v1/completions", timeout=60,
                       json={"model": TINY, "prompt": prefix + f"question {i}?", "max_tokens": 2})
        assert r.status_code == 200, r.text
    shared = {u: n - before.get(u, 0) for u, n in served(c, "ctx").items()}
    assert sorted(shared.values()) == [0, 6], shared  # one server took every shared-prefix request
    before = served(c, "ctx")
    for i in range(6):  # unrelated prompts (no common first block) spread over both servers
        r = httpx.post(c.url + "/v1/completions", timeout=60,
                       json={"model": TINY, "prompt": f"{i} unrelated topic number {i} " * 4, "max_tokens": 2})
        assert r.status_code == 200, r.text
    spread = {u: n - before.get(u, 0) for u, n in served(c, "ctx").items()}
    assert min(spread.values()) >= 2, spread


@INPROC_ONLY
def test_kill_9_ctx_under_load_retries_and_restarts(launched):
    c = launched
    ctx = c.settled("ctx", 2)
    victim = ctx[0]
    with Load(c.url, threads=2) as load:
        wait_for(lambda: load.done >= 4, 60, "the first requests")
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: any(s["url"] == victim["url"] and s["state"] != "ready" for s in c.servers("ctx")), 10,
                 "the orchestrator to notice the dead ctx server")
        done_at_kill = load.done
        # the launcher restarts it on the same address and it rejoins the pool
        rejoined = wait_for(lambda: next((s for s in c.servers("ctx") if s["url"] == victim["url"]
                                          and s["state"] == "ready" and s["pid"] not in (None, victim["pid"])), None),
                            90, "the restarted ctx server to rejoin")
        wait_for(lambda: load.done >= done_at_kill + 6, 60, "more requests after the kill")
    assert load.errors == [], load.errors[:5]
    assert rejoined["pid"] != victim["pid"]
    assert c.status()["pools"]["ctx"]["restarts"] == 1
    c.scale("ctx", 1)
    c.settled("ctx", 1)


def test_short_prompts_run_colocated_on_a_gen_server(launched):
    c = launched
    ctx_before = sum(served(c, "ctx").values())
    gen_before = sum(served(c, "gen").values())
    r = httpx.post(c.url + "/v1/completions", timeout=60, json={"model": TINY, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert sum(served(c, "ctx").values()) == ctx_before  # no context phase
    assert sum(served(c, "gen").values()) == gen_before + 1
    long_prompt = "a long prompt that is well over twelve tokens long, so it is disaggregated " * 2
    r = httpx.post(c.url + "/v1/completions", timeout=60, json={"model": TINY, "prompt": long_prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert sum(served(c, "ctx").values()) == ctx_before + 1
    metrics = httpx.get(c.url + "/metrics", timeout=5).text
    assert 'pdserve_orchestrator_routed_requests_total{path="colocated",pool="gen"}' in metrics


def test_metrics_on_orchestrator_and_servers(launched):
    c = launched
    text = httpx.get(c.url + "/metrics", timeout=5).text
    for name in ("pdserve_orchestrator_ttft_seconds_bucket", "pdserve_orchestrator_time_per_output_token_seconds",
                 "pdserve_orchestrator_inter_token_latency_seconds", "pdserve_orchestrator_e2e_latency_seconds",
                 "pdserve_orchestrator_queue_time_seconds", "pdserve_orchestrator_kv_transfer_seconds",
                 'pdserve_orchestrator_pool_servers{pool="gen",state="ready"} 1.0',
                 'pdserve_orchestrator_pool_target_instances{pool="ctx"} 1.0', "pdserve_orchestrator_errors_total"):
        assert name in text, name
    server = c.servers("gen")[0]["url"]
    text = httpx.get(server + "/metrics", timeout=5).text
    assert "pdserve_server_time_to_first_token_seconds_bucket" in text
    assert "pdserve_kv_transfer_seconds" in text


def test_admin_token_required(launched):
    c = launched
    url = c.url + "/cluster/pools/gen/scale"
    assert httpx.post(url, json={"instances": 2}, timeout=5).status_code == 401
    assert httpx.post(url, json={"instances": 2}, headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 403
    r = httpx.post(url, json={"instances": 9}, headers=AUTH, timeout=5)
    assert r.status_code == 400 and "max_instances" in r.json()["error"]["message"]
    assert c.status()["pools"]["gen"]["target"] == 1
