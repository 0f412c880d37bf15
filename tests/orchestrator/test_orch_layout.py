"""Join-time KV layout check: an incompatible ctx/gen pairing is refused and never looks healthy."""

from __future__ import annotations

import logging
import time

import httpx

from orch_fakes import KV_LAYOUT, MODEL, Behavior, Record, ThreadServer, make_fake_server
from orchestrator.pools import ClusterPools, Pool, Server, ServerState
from pdserve.kv_pairing import join_layout, join_mismatch
from test_orch_failures import wait_for
from test_orch_flow import COMPLETION

MISMATCH = "KV layout mismatch: block_size gen=32 ctx=16"


def test_join_mismatch_names_both_values_and_skips_heads_across_tp_sizes():
    assert join_mismatch(KV_LAYOUT, KV_LAYOUT) is None
    assert join_mismatch({**KV_LAYOUT, "block_size": 32}, KV_LAYOUT) == MISMATCH
    both = join_mismatch({**KV_LAYOUT, "dtype": "bfloat16", "head_dim": 16}, KV_LAYOUT, "ctx", "gen")
    assert both == "KV layout mismatch: dtype ctx=bfloat16 gen=float32; head_dim ctx=16 gen=8"
    # per-rank heads differ legitimately when TP sizes differ (the formatter splits heads) ...
    assert join_mismatch({**KV_LAYOUT, "num_kv_heads": 2, "tp_size": 1}, {**KV_LAYOUT, "tp_size": 2}) is None
    # ... but not when they are equal
    assert "num_kv_heads gen=2 ctx=1" in join_mismatch({**KV_LAYOUT, "num_kv_heads": 2}, KV_LAYOUT)
    # with every rank's layout the totals are compared, whatever the TP sizes (uneven splits too)
    ranks = [{**KV_LAYOUT, "tp_size": 2, "tp_rank": r, "num_kv_heads": h} for r, h in enumerate((2, 1))]
    ctx_tp2 = join_layout(ranks[0], ranks)
    assert ctx_tp2["total_kv_heads"] == 3
    assert join_mismatch(join_layout({**KV_LAYOUT, "num_kv_heads": 3}, [{**KV_LAYOUT, "num_kv_heads": 3}]),
                         ctx_tp2) is None
    assert join_mismatch(join_layout({**KV_LAYOUT, "num_kv_heads": 4}, [{**KV_LAYOUT, "num_kv_heads": 4}]),
                         ctx_tp2) == "KV layout mismatch: total_kv_heads gen=4 ctx=3"
    assert "total_kv_heads" not in join_layout(ranks[0], ranks[:1])  # incomplete: per-rank rule


def _server(role: str, i: int, **layout) -> Server:
    return Server(role, i, f"http://{role}{i}", kv_layout={**KV_LAYOUT, **layout})


def test_admission_first_accepted_fixes_the_layout_until_it_leaves():
    ctx, gen = Pool("ctx", [_server("ctx", 0)]), Pool("gen", [_server("gen", 0, block_size=32)])
    pools = ClusterPools(ctx, gen)
    assert pools.admit(ctx.servers[0]) and ctx.servers[0].state is ServerState.READY
    assert not pools.admit(gen.servers[0])
    bad = gen.servers[0]
    assert bad.state is ServerState.INCOMPATIBLE and not gen.ready()
    assert bad.last_error.startswith(MISMATCH) and "ctx[0] http://ctx0" in bad.last_error
    reason = pools.not_ready_reason()
    assert reason.startswith("gen pool has 0 of 1 ready servers") and MISMATCH in reason
    # a second ctx server that disagrees with the first one is refused too (naming both servers)
    ctx.servers.append(_server("ctx", 1, block_size=32))
    assert not pools.admit(ctx.servers[1])
    assert "block_size ctx[1]=32 ctx[0]=16" in ctx.servers[1].last_error
    good = gen.add("http://gen1", "registered")
    good.kv_layout = dict(KV_LAYOUT)
    assert pools.admit(good) and pools.not_ready_reason() is None
    # once every member that fixed block_size 16 is gone, the cluster may take another layout
    ctx.remove(ctx.servers[0], "test")
    gen.remove(good, "test")
    assert pools.admit(bad) and pools.admit(ctx.servers[0])  # ctx[1], block_size 32


def test_mismatched_pairing_is_refused_and_never_healthy_until_a_compatible_gen_joins(make_cluster, caplog, capsys):
    caplog.set_level(logging.WARNING, logger="orchestrator.pools")
    c = make_cluster(wait=False, layouts={"gen": [{"block_size": 32}]})

    def gen_states() -> list[tuple[str, str | None]]:
        servers = httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"]
        return [(s["state"], s["last_error"]) for s in servers]

    wait_for(lambda: gen_states()[0][0] == "incompatible")
    assert gen_states()[0][1].startswith(MISMATCH)
    for _ in range(10):  # many poll intervals (50 ms): it stays refused and the cluster unhealthy
        health = httpx.get(c.url + "/health", timeout=5)
        assert health.status_code == 503 and MISMATCH in health.json()["error"]["message"]
        time.sleep(0.05)
    assert gen_states()[0][0] == "incompatible"
    assert httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10).status_code >= 500
    assert c.gen[0].record.bodies == []  # never routed to
    refusals = [r for r in caplog.records if "is refused" in r.getMessage()]
    assert len(refusals) == 1 and MISMATCH in refusals[0].getMessage()  # logged once

    from orchestrator.cli import main
    assert main(["status", "--url", c.url]) == 3  # not ready
    out = capsys.readouterr().out
    assert "NOT READY" in out and "incompatible" in out and "block_size gen=32" in out

    # registering another block-size-32 gen server: 409 naming both values; it shows as incompatible
    wide = {**KV_LAYOUT, "block_size": 32}
    bad = ThreadServer(make_fake_server("gen", Behavior(kv_layout=wide), bad_rec := Record())).start()
    try:
        body = {"role": "gen", "url": bad.url, "model": MODEL, "state": "serving", "kv_layout": wide}
        r = httpx.post(c.url + "/cluster/workers", json=body, timeout=5)
        assert r.status_code == 409 and r.json()["error"]["message"].startswith(MISMATCH)
        time.sleep(0.2)  # a few polls: still refused
        assert [s for s, _ in gen_states()] == ["incompatible", "incompatible"]
        assert httpx.get(c.url + "/health", timeout=5).status_code == 503 and bad_rec.bodies == []
        httpx.delete(c.url + "/cluster/workers", params={"url": bad.url}, timeout=5)
    finally:
        bad.stop()

    # a compatible gen server joins: the cluster turns healthy and serves through it only
    good = ThreadServer(make_fake_server("gen", Behavior(), rec := Record())).start()
    try:
        body = {"role": "gen", "url": good.url, "model": MODEL, "state": "serving", "kv_layout": KV_LAYOUT}
        r = httpx.post(c.url + "/cluster/workers", json=body, timeout=5)
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text
        c.wait_ready()
        assert httpx.post(c.url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
        assert len(rec.bodies) == 1 and c.gen[0].record.bodies == []
        assert gen_states()[0][0] == "incompatible"
    finally:
        good.stop()


def test_a_server_without_a_layout_is_not_checked(make_cluster):
    c = make_cluster(layouts={"gen": [None]})  # its /server_info answers 404 (an older or foreign server)
    gen = httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"][0]
    assert gen["state"] == "ready" and gen["kv_layout"] is None
