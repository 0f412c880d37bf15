"""Control plane with fake servers: routers, registration + heartbeat + drops, min_instances,
non-stream client disconnect, scaling refused without a launcher, tokens, colocated short prompts."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from orch_fakes import MODEL
from orchestrator.pools import ClusterPools, Pool, Server, ServerState
from orchestrator.kv_index import KVIndexes
from orchestrator.router import KVCacheAwareRouter, LeastLoadedRouter, RouteHint, block_hashes
from pdserve.kv_events import KVSnapshot
from test_orch_failures import wait_for
from test_orch_flow import CHAT, COMPLETION


def pool_of(n: int) -> Pool:
    return Pool("ctx", [Server("ctx", i, f"http://s{i}", state=ServerState.READY) for i in range(n)])


def test_least_loaded_picks_fewest_in_flight_and_skips_draining():
    p = pool_of(3)
    p.servers[0].in_flight, p.servers[1].in_flight = 2, 1
    p.servers[2].start_draining()
    assert LeastLoadedRouter().pick(p, set()).url == "http://s1"
    assert LeastLoadedRouter().pick(p, {"http://s1"}).url == "http://s0"


def test_kv_cache_aware_affinity_and_balance():
    indexes = KVIndexes()
    p = pool_of(2)
    r = KVCacheAwareRouter(indexes, balance_threshold=2)
    shared = list(range(100, 140))
    hint = lambda tail: RouteHint(block_hashes(shared + tail, 4), 44)  # noqa: E731
    for s in p.servers:
        indexes.get(s.url).load_snapshot(KVSnapshot("e", 0, ()))
    first = p.servers[1]
    indexes.get(first.url).load_snapshot(KVSnapshot("e", 0, hint([1, 2, 3, 4]).block_hashes[:10]))  # holds the prefix
    assert all(r.pick(p, set(), hint([i, i, i, i])) is first for i in range(5, 10))  # same prefix, same server
    other = next(s for s in p.servers if s is not first)
    unrelated = [r.pick(p, set(), RouteHint(block_hashes([i] * 40, 4), 40)).url for i in range(4)]
    assert set(unrelated) == {first.url, other.url}  # no shared prefix: spread
    first.in_flight = 3  # too busy: load wins over affinity
    assert r.pick(p, set(), hint([7, 7, 7, 7])) is other


def register(url: str, body: dict, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + "/cluster/workers", json=body, headers=headers, timeout=5)


def test_registration_heartbeat_ttl_and_health_drops(make_cluster):
    c = make_cluster(heartbeat_ttl_s=0.6, health_failure_threshold=2)
    extra = c.gen[0].server.url  # a second registration for the same fake gen server under another name
    alias = extra.replace("127.0.0.1", "localhost")
    r = register(c.url, {"role": "gen", "url": alias, "model": MODEL, "state": "serving"})
    assert r.status_code == 200 and r.json()["state"] == "ready"
    status = httpx.get(c.url + "/cluster/status", timeout=5).json()
    assert [s["source"] for s in status["pools"]["gen"]["servers"]] == ["static", "registered"]
    assert register(c.url, {"role": "gen", "url": alias, "model": "other"}).status_code == 409
    # no heartbeat for longer than the TTL: dropped
    wait_for(lambda: len(httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"]) == 1)
    # a registered server whose /health fails twice in a row is dropped too
    register(c.url, {"role": "ctx", "url": "http://127.0.0.1:9", "model": MODEL})
    stop = threading.Event()
    heartbeats = threading.Thread(
        target=lambda: [register(c.url, {"role": "ctx", "url": "http://127.0.0.1:9", "model": MODEL})
                        for _ in iter(lambda: stop.wait(0.1), True)], daemon=True)
    heartbeats.start()
    try:
        wait_for(lambda: [s["url"] for s in httpx.get(c.url + "/cluster/status").json()["pools"]["ctx"]["servers"]]
                 == [c.ctx[0].server.url])
    finally:
        stop.set()
        heartbeats.join(10)  # not past the cluster's teardown: a late POST would hit a closed port


def test_not_ready_until_min_instances():
    gen = Pool("gen", [Server("gen", 0, "http://a", state=ServerState.READY)], min_instances=2)
    pools = ClusterPools(Pool("ctx", [Server("ctx", 0, "http://c", state=ServerState.READY)]), gen)
    assert "gen pool has 1 of 2 ready servers" in pools.not_ready_reason()
    gen.add("http://b", "registered").mark_ready()
    assert pools.not_ready_reason() is None


def test_non_stream_client_disconnect_cancels_gen_and_releases_lease(make_cluster):
    c = make_cluster()
    c.gen[0].behavior.answer_delay_s = 5.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=0.5)
    wait_for(lambda: c.gen[0].record.aborted_requests == 1)
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)  # the parked lease is given back
    wait_for(lambda: c.gen[0].record.bodies and httpx.get(c.url + "/cluster/status").json()
             ["pools"]["gen"]["in_flight"] == 0)


def test_a_client_that_leaves_after_a_big_body_is_still_noticed(make_cluster):
    """A body over uvicorn's 64 KiB high-water mark pauses reading until receive() resumes it; the
    disconnect hook calls no receive(), so the protocol reads on once the body is whole
    (HeadWithBodyProtocol.on_message_complete): the client's close still aborts the gen request."""
    c = make_cluster()
    c.gen[0].behavior.answer_delay_s = 5.0
    big = {**COMPLETION, "prompt": "word " * 40_000}  # ~200 KB: one read past the high-water mark
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.url + "/v1/completions", json=big, timeout=1.0)
    wait_for(lambda: c.gen[0].record.aborted_requests == 1)
    wait_for(lambda: len(c.ctx[0].record.releases) == 1)


def test_scale_needs_token_and_a_launcher(make_cluster, monkeypatch):
    c = make_cluster()
    url = c.url + "/cluster/pools/gen/scale"
    r = httpx.post(url, json={"instances": 2}, timeout=5)
    assert r.status_code == 403 and "PDSERVE_ADMIN_TOKEN" in r.json()["error"]["message"]  # no token configured
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "s3cret")
    assert httpx.post(url, json={"instances": 2}, timeout=5).status_code == 401
    assert httpx.post(url, json={"instances": 2}, headers={"Authorization": "Bearer x"}, timeout=5).status_code == 403
    r = httpx.post(url, json={"instances": 2}, headers={"Authorization": "Bearer s3cret"}, timeout=5)
    assert r.status_code == 409 and "external" in r.json()["error"]["message"]
    assert register(c.url, {"role": "gen", "url": "http://x:1", "model": MODEL}).status_code == 401


def test_status_command_prints_a_table(cluster, capsys):
    from orchestrator.cli import main

    assert main(["status", "--url", cluster.url]) == 0
    out = capsys.readouterr().out
    assert "ctx[0]" in out and "gen[0]" in out and "ready" in out and "round_robin" in out
