"""The orchestrator's prefix-cache admin route and its hashes (fake servers)."""
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
