"""The orchestrator's prefix-cache admin route and its hashes (fake servers)."""
import time

import httpx

AUTH = {"Authorization": "Bearer s3cret"}


def test_reset_prefix_cache_fans_out_with_the_admin_token(make_cluster, monkeypatch):
    c = make_cluster(n_ctx=2, n_gen=1)
    url = c.url + "/reset_prefix_cache"
    assert httpx.post(url, timeout=5).status_code == 403          # no token configured: refused
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "s3cret")
    assert httpx.post(url, timeout=5).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer x"}, timeout=5).status_code == 403
    assert all(not n.record.prefix_resets for n in c.ctx + c.gen)  # refused calls reach no server
    r = httpx.post(url, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["freed_blocks"] == 9 and len(body["servers"]) == 3
    assert [n.record.prefix_resets for n in c.ctx + c.gen] == [["Bearer s3cret"]] * 3


def test_reset_prefix_cache_names_a_failed_server(make_cluster, monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "s3cret")
    c = make_cluster(n_ctx=1, n_gen=1)
    c.gen[0].behavior.reset_status = 503
    r = httpx.post(c.url + "/reset_prefix_cache", headers=AUTH, timeout=10)
    assert r.status_code == 502
    servers = r.json()["servers"]
    assert servers[c.topology.server_url("ctx", 0)] == {"freed_blocks": 3}
    assert "503" in servers[c.topology.server_url("gen", 0)]["error"]


def test_reset_prefix_cache_names_the_servers_it_skipped(make_cluster, monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "s3cret")
    c = make_cluster(n_ctx=2, n_gen=1)
    c.ctx[1].behavior.health_status = 503
    down = c.topology.server_url("ctx", 1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = {s["url"]: s["state"] for s in httpx.get(c.url + "/cluster/status", timeout=5).json()
                  ["pools"]["ctx"]["servers"]}
        if states[down] != "ready":
            break
        time.sleep(0.02)
    r = httpx.post(c.url + "/reset_prefix_cache", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["skipped"] == {down: states[down]} and states[down] != "ready"
    assert set(body["servers"]) == {c.topology.server_url("ctx", 0), c.topology.server_url("gen", 0)}
    assert not c.ctx[1].record.prefix_resets and c.ctx[0].record.prefix_resets


def test_auto_dtype_hashes_with_the_dtype_the_servers_report():
    """engine.dtype: auto resolves on each server's CPU: the router must name blocks with the
    dtype the accepted servers report, or its hashes never equal the servers' block names."""
    from orchestrator.pools import ClusterPools, Pool, Server
    from pdserve.block_hash import BlockHasher

    ctx, gen = Server("ctx", 0, "http://127.0.0.1:1"), Server("gen", 0, "http://127.0.0.1:2")
    pools = ClusterPools(Pool("ctx", [ctx], 1), Pool("gen", [gen], 1))
    assert pools.accepted_dtype() is None                       # nothing accepted yet
    gen.kv_layout, gen.layout_ok = {"dtype": "bfloat16", "block_size": 4}, True
    assert pools.accepted_dtype() == "bfloat16"
    ids = list(range(12))
    assert (BlockHasher("m", "bfloat16", 4).hashes(ids) != BlockHasher("m", "auto", 4).hashes(ids))
