"""Real processes (tiny model): a gen server started with another KV block size than its ctx
server is refused when it joins; the orchestrator never turns healthy with only that pairing."""

from __future__ import annotations

import httpx
import yaml

from tests.control_plane.conftest import wait_for
from tests.integration.conftest import TINY_NAME, procs  # noqa: F401 - fixture
from tests.integration.procs import write_topology


def test_block_size_mismatch_is_refused_at_join(tiny_model_dir, procs, tmp_path):  # noqa: F811 - fixtures
    topo = write_topology(tmp_path / "cluster.yaml", str(tiny_model_dir), TINY_NAME,
                          orchestrator={"health_interval_s": 0.1})  # block_size 4
    doc = yaml.safe_load(topo.read_text())
    doc["engine"]["block_size"] = 8  # same cluster (ports, orchestrator), another KV block size
    wide = tmp_path / "gen_block8.yaml"
    wide.write_text(yaml.safe_dump(doc))
    o = doc["orchestrator"]
    url = f"http://{o['host']}:{o['port']}"
    servers = {role: "http://{host}:{port}".format(**doc["pools"][role]["servers"][0]) for role in ("ctx", "gen")}
    for role, cfg in (("ctx", topo), ("gen", wide)):
        procs.start(f"{role}0", "-m", f"{role}_worker", "--config", str(cfg), "--index", "0",
                    "--log-dir", str(procs.log_dir))
    procs.start("orchestrator", "-m", "orchestrator", "--config", str(topo))
    for role in ("ctx", "gen"):
        procs.wait_healthy(f"{role}0", servers[role])

    def refused() -> dict | None:
        try:
            pools = httpx.get(url + "/cluster/status", timeout=2).json()["pools"]
        except httpx.HTTPError:
            return None
        return next((s for p in pools.values() for s in p["servers"] if s["state"] == "incompatible"), None)

    # Whichever joined first fixes the layout; the other one is refused, naming both values.
    bad = wait_for(refused, 30, f"a refused server\n{procs.log('orchestrator')[-3000:]}")
    assert bad["last_error"].startswith("KV layout mismatch: block_size "), bad
    assert {"gen=8", "ctx=4"} <= set(bad["last_error"].replace(";", " ").split()), bad
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and "block_size" in health.json()["error"]["message"]
    if bad["name"] == "gen[0]":  # its registration heartbeat is answered 409 with the same message
        layout = httpx.get(servers["gen"] + "/server_info", timeout=5).json()["kv_layout"]
        body = {"role": "gen", "url": servers["gen"], "model": TINY_NAME, "state": "serving", "kv_layout": layout}
        r = httpx.post(url + "/cluster/workers", json=body, timeout=5)
        assert r.status_code == 409 and "block_size gen=8 ctx=4" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code >= 500
    assert "is refused: KV layout mismatch" in procs.log("orchestrator")
