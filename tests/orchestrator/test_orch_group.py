"""Pieces of an orchestrator process group, in process: the owner <-> worker feed
(:mod:`orchestrator.feed`), the metrics sum, the port check, and the K = 1 path."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
from prometheus_client import generate_latest

from orchestrator import jsonio
from orchestrator.feed import FeedHub, WorkerReport, apply_view
from orchestrator.metrics import Metrics
from orchestrator.metrics_sum import sum_expositions
from orchestrator.pools import ClusterPools, Pool, Server, ServerState
from orchestrator.process_group import (RESTART_BACKOFF_S, WORKER_HEADER, ProcessSpec, WorkerSupervisor,
                                        bind_public, check_port_free)


def _pools(n_gen: int = 2) -> ClusterPools:
    ctx = Pool("ctx", [Server("ctx", 0, "http://c0")])
    gen = Pool("gen", [Server("gen", i, f"http://g{i}") for i in range(n_gen)])
    for s in ctx.servers + gen.servers:
        s.mark_ready()
    return ClusterPools(ctx, gen)


def test_in_flight_is_local_plus_remote_and_changes_only_the_local_part():
    s = Server("gen", 0, "http://g0")
    s.remote_in_flight = 5
    s.in_flight += 1
    assert (s.local_in_flight, s.in_flight) == (1, 6)
    with s.track():
        assert s.in_flight == 7
    s.in_flight -= 1
    assert (s.local_in_flight, s.remote_in_flight, s.in_flight) == (0, 5, 5)


def test_owner_sums_reports_and_each_worker_sees_the_others_load():
    owner = _pools()
    owner.gen.servers[0].local_in_flight = 1
    hub = FeedHub(owner)
    hub.receive(WorkerReport(1, 101, {"http://g0": 2}))
    view2 = jsonio.loads(hub.receive(WorkerReport(2, 102, {"http://g0": 3, "http://g1": 4})))
    g0, g1 = owner.gen.servers
    assert (g0.remote_in_flight, g0.in_flight, g1.in_flight) == (5, 6, 4)
    others = {s["url"]: s["others_in_flight"] for s in view2["servers"]}
    assert others == {"http://c0": 0, "http://g0": 3, "http://g1": 0}  # owner 1 + worker 1's 2; nothing but its own on g1
    hub.forget(2)  # worker 2 died: its requests died with it
    assert (g0.in_flight, g1.in_flight) == (3, 0)


def test_a_worker_mirrors_membership_state_and_load_keeping_its_own_counters():
    owner, worker = _pools(), _pools(n_gen=1)
    mine = worker.gen.servers[0]
    mine.local_in_flight = 2
    owner.gen.servers[1].mark_unhealthy("connect refused")
    owner.gen.servers[0].local_in_flight = 3
    hub = FeedHub(owner)
    added, removed = apply_view(worker, jsonio.loads(hub.receive(WorkerReport(1, 1, {"http://g0": 2})))["servers"])
    assert [s.url for s in added] == ["http://g1"] and removed == []
    assert worker.gen.servers[0] is mine and mine.in_flight == 2 + 3
    assert worker.gen.servers[1].state is ServerState.UNHEALTHY
    owner.gen.remove(owner.gen.servers[1], "gone")
    added, removed = apply_view(worker, jsonio.loads(hub.view_for(1))["servers"])
    assert added == [] and [s.url for s in removed] == ["http://g1"]
    assert [s.url for s in worker.gen.servers] == ["http://g0"]


def test_a_failure_seen_by_a_worker_reaches_the_owner_and_is_not_undone_by_an_older_view():
    owner, worker = _pools(), _pools()
    hub = FeedHub(owner)
    apply_view(worker, jsonio.loads(hub.view_for(1))["servers"])
    worker.gen.servers[1].mark_unhealthy("gen attempt failed: ConnectError")
    old_view = jsonio.loads(hub.view_for(1))["servers"]  # computed before the owner heard of it
    apply_view(worker, old_view, keep_state={"http://g1"})
    assert worker.gen.servers[1].state is ServerState.UNHEALTHY
    hub.receive(WorkerReport(1, 1, unhealthy=[("http://g1", "gen attempt failed: ConnectError")]))
    assert owner.gen.servers[1].state is ServerState.UNHEALTHY
    assert "worker 1" in owner.gen.servers[1].last_error


def test_report_round_trips_and_a_malformed_one_is_refused():
    r = WorkerReport(3, 77, {"http://g0": 2}, [("http://g1", "boom")])
    assert WorkerReport.from_json(r.to_json()) == r
    for bad in (b"{}", b"[]", b'{"worker": 1, "pid": 1, "in_flight": {"u": "x"}, "unhealthy": []}'):
        try:
            WorkerReport.from_json(bad)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_the_owner_adds_each_workers_kv_hit_self_check_to_its_own():
    # review2: with num_workers 2, /cluster/status (and so `pdserve status`) showed process 0's
    # predicted/reported hit tokens alone while /metrics summed all processes.
    hits = {"ctx": {"requests": 2, "prompt_tokens": 80, "predicted_hit_tokens": 40, "reported_hit_tokens": 36,
                    "unindexed": 1}}
    r = WorkerReport(1, 101, {}, [], hits)
    assert WorkerReport.from_json(r.to_json()) == r
    hub = FeedHub(_pools())
    hub.receive(r)
    hub.receive(WorkerReport(2, 102, {}, [], {"ctx": {**hits["ctx"], "requests": 3}}))
    assert hub.kv_hits("ctx") == {"requests": 5, "prompt_tokens": 160, "predicted_hit_tokens": 80,
                                  "reported_hit_tokens": 72, "unindexed": 2}
    assert hub.kv_hits("gen") == {}
    hub.forget(2)  # an exited worker's counts go, as its /metrics do
    assert hub.kv_hits("ctx")["requests"] == 2


def _value(text: bytes, series: str) -> float:
    m = re.search(rb"^" + re.escape(series.encode()) + rb" (\S+)$", text, re.M)
    assert m, series
    return float(m.group(1))


def test_metrics_sum_adds_counters_histograms_and_in_flight_but_takes_the_view_from_the_owner():
    owner_pools, worker_pools = _pools(), _pools()
    a, b = Metrics(), Metrics()
    a.requests.labels("/v1/completions", "200").inc(3)
    b.requests.labels("/v1/completions", "200").inc(4)
    b.requests.labels("/v1/completions", "429").inc()
    a.ttft.labels("/v1/completions").observe(0.004)
    b.ttft.labels("/v1/completions").observe(0.2)
    owner_pools.gen.servers[0].local_in_flight, worker_pools.gen.servers[0].local_in_flight = 2, 5
    worker_pools.gen.servers[0].remote_in_flight = 2  # must not be counted twice
    a.processes.set(2)
    out = sum_expositions([a.render(owner_pools), b.render(worker_pools)])
    assert _value(out, 'pdserve_orchestrator_requests_total{endpoint="/v1/completions",status="200"}') == 7
    assert _value(out, 'pdserve_orchestrator_requests_total{endpoint="/v1/completions",status="429"}') == 1
    assert _value(out, 'pdserve_orchestrator_ttft_seconds_bucket{endpoint="/v1/completions",le="0.005"}') == 1
    assert _value(out, 'pdserve_orchestrator_ttft_seconds_count{endpoint="/v1/completions"}') == 2
    assert _value(out, 'pdserve_orchestrator_pool_in_flight_requests{pool="gen"}') == 7
    assert _value(out, 'pdserve_orchestrator_pool_servers{pool="gen",state="ready"}') == 2  # not 4
    assert _value(out, "pdserve_orchestrator_processes") == 2
    assert b"_created" not in out
    assert generate_latest(a.registry) != out  # really merged, not the owner's text


def test_one_process_is_todays_path_no_group_no_worker_header(cluster):
    orch = cluster.orchestrator.server.config.app.orchestrator
    assert orch.settings.num_workers == 1 and orch.side is None
    body = {"model": cluster.topology.model.name, "prompt": "hi", "max_tokens": 2}
    resp = httpx.post(cluster.url + "/v1/completions", json=body, timeout=10, trust_env=False)
    assert resp.status_code == 200 and WORKER_HEADER.decode() not in resp.headers
    status = httpx.get(cluster.url + "/cluster/status", timeout=10, trust_env=False).json()
    assert "processes" not in status


def test_the_owner_refuses_a_port_someone_listens_on_even_with_so_reuseport():
    taken = bind_public("127.0.0.1", 0)  # SO_REUSEPORT, as another orchestrator group would bind
    port = taken.getsockname()[1]
    check_port_free("127.0.0.1", port)  # bound but not listening: no conflict yet
    taken.listen()
    try:
        with pytest.raises(OSError):
            check_port_free("127.0.0.1", port)
    finally:
        taken.close()


def test_supervisor_restarts_a_crashed_worker_up_to_its_budget_but_not_one_stopped_on_purpose():
    spec = ProcessSpec(0, 3, "/nonexistent", "t", os.getpid())
    exited: list[int] = []
    sup = WorkerSupervisor(spec, {}, max_restarts=1, on_exit=exited.append, on_tick=lambda: None)
    crashed, stopped = sup.slots
    crashed.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    stopped.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(0)"])
    crashed.proc.wait(30), stopped.proc.wait(30)
    spawned: list[int] = []
    sup._spawn = lambda slot: (spawned.append(slot.index), setattr(slot, "restart_at_s", None))  # no real worker
    sup._check(crashed, now=100.0)
    sup._check(stopped, now=100.0)
    assert exited == [1, 2] and crashed.restart_at_s == 100.0 + RESTART_BACKOFF_S and stopped.given_up
    sup._check(crashed, now=100.5)
    assert spawned == []  # the back-off holds
    sup._check(crashed, now=101.5)
    assert spawned == [1] and crashed.restarts == 1
    sup._check(crashed, now=102.0)  # the same dead process again: its budget of 1 is spent
    assert spawned == [1] and crashed.given_up
    assert [s["restarts"] for s in sup.status()] == [1, 0]


def test_a_worker_refuses_to_start_by_hand_or_after_its_owner_died():
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ORCH_ATTACH"}
    by_hand = subprocess.run([sys.executable, "-m", "orchestrator.worker_main"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert by_hand.returncode == 2 and "started by the orchestrator's owner" in by_hand.stderr
    orphan = ProcessSpec(1, 2, "/nonexistent", "t", owner_pid=os.getpid() + 10**6)  # not its parent
    env["PDSERVE_ORCH_ATTACH"] = orphan.to_env({"topology": {}, "log_level": "warning"})
    late = subprocess.run([sys.executable, "-m", "orchestrator.worker_main"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert late.returncode == 1 and "is gone" in late.stderr
