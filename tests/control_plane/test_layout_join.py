"""Real processes (tiny model): a gen server whose KV layout differs from its ctx server's (another
block size; another dtype, with gen's `auto` resolved on this CPU) is refused when it joins, with
both values named; the orchestrator never turns healthy with only that pairing."""

from __future__ import annotations

import httpx
import pytest
import yaml

from pdserve.dtypes import read_cpu_flags, resolve_dtype
from tests.control_plane.conftest import wait_for
from tests.integration.conftest import TINY_NAME, procs  # noqa: F401 - fixture
from tests.integration.procs import write_topology

HERE = resolve_dtype("auto", read_cpu_flags())  # what a server on this machine makes of `auto`
OTHER = {"float32": "bfloat16", "bfloat16": "float32"}[HERE]


@pytest.mark.parametrize("field,ctx_engine,gen_engine,gen_value,ctx_value", [
    ("block_size", {}, {"block_size": 8}, "8", "4"),
    ("dtype", {"dtype": OTHER}, {"dtype": "auto"}, HERE, OTHER),  # /server_info reports the resolved dtype
])
def test_layout_mismatch_is_refused_at_join(tiny_model_dir, procs, tmp_path,  # noqa: F811 - fixtures
                                            field, ctx_engine, gen_engine, gen_value, ctx_value):
    # block_size 4; inproc engines: the join-time check reads /server_info, whichever executor
    # runs behind it, and an inproc server starts seconds sooner than an MPI lattice
    base = write_topology(tmp_path / "cluster.yaml", str(tiny_model_dir), TINY_NAME, engine={"executor": "inproc"},
                          orchestrator={"health_interval_s": 0.1})
    doc = yaml.safe_load(base.read_text())
    topo, wide = tmp_path / "ctx.yaml", tmp_path / "gen.yaml"  # same cluster (ports, orchestrator)
    for path, engine in ((topo, ctx_engine), (wide, gen_engine)):
        path.write_text(yaml.safe_dump({**doc, "engine": {**doc["engine"], **engine}}))
    o = doc["orchestrator"]
    url = f"http://{o['host']}:{o['port']}"
    servers = {role: "http://{host}:{port}".format(**doc["pools"][role]["servers"][0]) for role in ("ctx", "gen")}
    names = {n: f"{n}_{field}" for n in ("ctx", "gen", "orchestrator")}  # each case has its own logs
    try:
        for role, cfg in (("ctx", topo), ("gen", wide)):
            procs.start(names[role], "-m", f"{role}_worker", "--config", str(cfg), "--index", "0",
                        "--log-dir", str(procs.log_dir))
        procs.start(names["orchestrator"], "-m", "orchestrator", "--config", str(topo))
        for role in ("ctx", "gen"):
            procs.wait_healthy(names[role], servers[role])
        reported = {role: httpx.get(servers[role] + "/server_info", timeout=5).json()["kv_layout"]["dtype"]
                    for role in ("ctx", "gen")}  # `auto` resolved by each server, never "auto" itself
        want = {role: resolve_dtype({**doc["engine"], **engine}.get("dtype", "auto"), read_cpu_flags())
                for role, engine in (("ctx", ctx_engine), ("gen", gen_engine))}
        assert reported == want, reported

        def refused() -> dict | None:
            try:
                pools = httpx.get(url + "/cluster/status", timeout=2).json()["pools"]
            except httpx.HTTPError:
                return None
            return next((s for p in pools.values() for s in p["servers"] if s["state"] == "incompatible"), None)

        # Whichever joined first fixes the layout; the other one is refused, naming both values.
        bad = wait_for(refused, 30, f"a refused server\n{procs.log(names['orchestrator'])[-3000:]}")
        assert bad["last_error"].startswith(f"KV layout mismatch: {field} "), bad
        assert {f"gen={gen_value}", f"ctx={ctx_value}"} <= set(bad["last_error"].replace(";", " ").split()), bad
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and field in health.json()["error"]["message"]
        if bad["name"] == "gen[0]":  # its registration heartbeat is answered 409 with the same message
            layout = httpx.get(servers["gen"] + "/server_info", timeout=5).json()["kv_layout"]
            body = {"role": "gen", "url": servers["gen"], "model": TINY_NAME, "state": "serving", "kv_layout": layout}
            r = httpx.post(url + "/cluster/workers", json=body, timeout=5)
            assert r.status_code == 409 and f"{field} gen={gen_value} ctx={ctx_value}" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/completions", json={"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code >= 500
        assert "is refused: KV layout mismatch" in procs.log(names["orchestrator"])
    finally:  # this case's processes end with it
        procs.stop(*(name for name in (names["orchestrator"], names["gen"], names["ctx"]) if name in procs.procs))

