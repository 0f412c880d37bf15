"""A server that got SIGTERM asks ``POST /cluster/workers/drain`` how to drain (issue 14: SIGTERM
drains by moving KV): move_kv only for a gen server with another gen server ready (and moves on);
the member gets no new requests from then on."""

from __future__ import annotations

import httpx
import pytest

from orchestrator.drain_notice import answer_drain_notice, move_kv_refusal
from orchestrator.pools import ClusterPools, Pool, Server, ServerState
from pdserve.config import OrchestratorSettings
from test_orch_flow import COMPLETION


def pools_of(n_gen_ready: int) -> ClusterPools:
    gen = [Server("gen", i, f"http://g{i}", state=ServerState.READY) for i in range(n_gen_ready)]
    return ClusterPools(Pool("ctx", [Server("ctx", 0, "http://c0", state=ServerState.READY)]), Pool("gen", gen))


def test_a_gen_server_moves_only_when_another_gen_server_is_ready():
    settings, pools = OrchestratorSettings(), pools_of(2)
    g0, g1 = pools.gen.servers
    assert move_kv_refusal(settings, pools, g0) is None
    assert answer_drain_notice(settings, pools, g0)["mode"] == "move_kv"
    assert g0.state is ServerState.UNHEALTHY and pools.gen.ready() == [g1]  # routed nothing new from now on
    # The last ready gen server has nowhere to move to: it waits.
    answer = answer_drain_notice(settings, pools, g1)
    assert answer == {"mode": "wait", "reason": "no other gen server is ready to take its requests"}


@pytest.mark.parametrize("settings,why", [
    ({"drain_mode": "wait"}, "orchestrator.drain_mode is wait"),
    ({"migration_limit": 0}, "migration_limit is 0, so no stream is movable"),
])
def test_moves_turned_off_mean_wait(settings, why):
    pools = pools_of(2)
    assert answer_drain_notice(OrchestratorSettings(**settings), pools, pools.gen.servers[0]) == \
        {"mode": "wait", "reason": why}


def test_a_ctx_server_waits_and_a_retiring_member_stays_draining():
    settings, pools = OrchestratorSettings(), pools_of(2)
    assert answer_drain_notice(settings, pools, pools.ctx.servers[0])["mode"] == "wait"
    g0 = pools.gen.servers[0]
    g0.start_draining()  # a scale-down retires it; its stop is a SIGTERM, which asks again
    assert answer_drain_notice(settings, pools, g0)["mode"] == "move_kv"
    assert g0.state is ServerState.DRAINING


def test_the_route_answers_members_and_refuses_strangers(make_cluster):
    c = make_cluster(n_gen=2)
    (g0, n0), (g1, n1) = ((n.server.url, n) for n in c.gen)
    n0.behavior.health_status = 503  # a draining server's /health, as the real one answers after SIGTERM
    r = httpx.post(c.url + "/cluster/workers/drain", json={"url": g0}, timeout=5)
    assert r.status_code == 200 and r.json()["mode"] == "move_kv", r.text
    status = httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"]
    assert {s["url"]: s["state"] for s in status}[g0] == "unhealthy"
    for _ in range(4):  # round robin over two gen servers: every request goes to the other one now
        assert httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    assert len(n0.record.bodies) == 0 and len(n1.record.bodies) == 4
    assert httpx.post(c.url + "/cluster/workers/drain", json={"url": g1}, timeout=5).json()["mode"] == "wait"
    assert httpx.post(c.url + "/cluster/workers/drain", json={"url": "http://127.0.0.1:1"},
                      timeout=5).status_code == 404
    assert httpx.post(c.url + "/cluster/workers/drain", json={"url": "not a url"}, timeout=5).status_code == 422
