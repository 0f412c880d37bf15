"""KV-event routing end to end, over real sockets (tiny random Llama, block size 4): two ctx
servers and one gen server (engines in threads of this process, each behind its own uvicorn) and
the orchestrator with ``kv_cache_aware`` in both pools. A prompt whose prefix one ctx server holds
(computed there by a request sent straight to it) is routed to that server, which reports the hit;
the orchestrator's predicted-vs-reported counters move together; a restarted ctx server gets a
new index (new epoch, empty)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import uvicorn

from executor.http_server import create_server_app
from executor.server_main import build_inproc_state
from orchestrator.app import create_app
from pdserve.config import load_topology
from tests.integration.conftest import TINY_NAME
from tests.integration.procs import write_topology

BS = 4


class ThreadedUvicorn:
    """One ASGI app served by uvicorn in a daemon thread on ``host:port``."""

    def __init__(self, app, host: str, port: int) -> None:
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout_s: float = 60.0) -> "ThreadedUvicorn":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"{self.url} did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    path = write_topology(tmp_path_factory.mktemp("kvroute") / "kv.yaml", str(tiny_model_dir), TINY_NAME,
                          num_ctx=2, engine={"executor": "inproc", "num_kv_blocks": 128},
                          kv_transfer={"backend": "tcp"},
                          orchestrator={"router": "kv_cache_aware", "max_local_prefill_length": 0,
                                        "health_interval_s": 0.1})
    topo = load_topology(path)
    servers = {}
    try:
        for role, n in (("ctx", 2), ("gen", 1)):
            for i in range(n):
                cfg = topo.server_config(role, i)
                servers[f"{role}{i}"] = ThreadedUvicorn(create_server_app(build_inproc_state(cfg)),
                                                        cfg.host, cfg.port).start()
        orch = ThreadedUvicorn(create_app(topo), topo.orchestrator.host, topo.orchestrator.port).start()
        servers = {"orchestrator": orch, **servers}  # stopped first: its subscriptions end before the servers
        wait_for(lambda: httpx.get(orch.url + "/health", timeout=5).status_code == 200, 60, "the cluster")
        wait_for(lambda: all(s["kv_index"] and s["kv_index"]["synced"] for s in servers_status(orch.url)), 30,
                 "every member's KV index to sync")
        servers["topology"] = topo  # type: ignore[assignment]
        yield servers
    finally:
        servers.pop("topology", None)
        for s in servers.values():
            s.stop()


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def servers_status(url: str) -> list[dict]:
    pools = httpx.get(url + "/cluster/status", timeout=5).json()["pools"]
    return pools["ctx"]["servers"] + pools["gen"]["servers"]


def ctx_status(url: str) -> dict:
    return httpx.get(url + "/cluster/status", timeout=5).json()["pools"]["ctx"]


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": TINY_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str, pool: str) -> float:
    m = re.search(rf'^{name}_total{{pool="{pool}"}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("holder", ["ctx1", "ctx0"])
def test_a_prompt_goes_to_the_ctx_server_that_holds_its_prefix(cluster, holder, capsys):
    orch = cluster["orchestrator"].url
    base = 11 if holder == "ctx1" else 500
    prefix = [base + (3 * i) % 400 for i in range(40)]  # 10 full blocks
    warm = complete(cluster[holder].url, prefix + [7])  # computed on the holder only (colocated there)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    holder_url = cluster[holder].url
    wait_for(lambda: next(s for s in ctx_status(orch)["servers"] if s["url"] == holder_url)["kv_index"]["blocks"] >= 10,
             10, "the holder's stored events to reach the orchestrator")
    before = {s["url"]: s["served"] for s in ctx_status(orch)["servers"]}
    hits_before = ctx_status(orch)["kv_hits"]
    metrics_before = httpx.get(orch + "/metrics", timeout=5).text

    answer = complete(orch, prefix + [9, 9, 9])  # 43 tokens: the 10 prefix blocks can be hit
    served = {s["url"]: s["served"] - before[s["url"]] for s in ctx_status(orch)["servers"]}
    assert served[holder_url] == 1 and sum(served.values()) == 1, served
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # the ctx server's own hit

    hits = ctx_status(orch)["kv_hits"]
    assert hits["requests"] == hits_before["requests"] + 1
    assert hits["predicted_hit_tokens"] - hits_before["predicted_hit_tokens"] == 40
    assert hits["reported_hit_tokens"] - hits_before["reported_hit_tokens"] == 40
    assert hits["unindexed"] == hits_before["unindexed"]
    text = httpx.get(orch + "/metrics", timeout=5).text
    for name in ("pdserve_orchestrator_kv_predicted_hit_tokens", "pdserve_orchestrator_kv_reported_hit_tokens"):
        assert metric(text, name, "ctx") - metric(metrics_before, name, "ctx") == 40, name
    assert metric(text, "pdserve_orchestrator_kv_checked_prompt_tokens", "ctx") - \
        metric(metrics_before, "pdserve_orchestrator_kv_checked_prompt_tokens", "ctx") == 43
    # the gen pool's index follows its server too: the pulled prompt joined the gen cache
    gen_hashes = set(httpx.get(cluster["gen0"].url + "/kv_events/snapshot", timeout=5).json()["hashes"])
    assert len(gen_hashes) >= 10
    wait_for(lambda: servers_status(orch)[-1]["kv_index"]["blocks"] == len(gen_hashes), 10, "the gen index")
    # pdserve status shows every index and the pool's self-check
    from orchestrator.cli import main
    assert main(["status", "--url", orch]) == 0
    out = capsys.readouterr().out
    assert out.count("synced") == 3 and "prefix hits" in out
    assert f"reported {hits['reported_hit_tokens']} hit tokens" in out


def test_a_restarted_server_gets_a_new_index(cluster):
    """ctx1 stops (its stream breaks: index gone at once) and a new engine starts on its address:
    the orchestrator subscribes again and rebuilds the index from the new epoch's snapshot, so the
    prefix the old process held no longer attracts requests."""
    orch, topo = cluster["orchestrator"].url, cluster["topology"]
    old = cluster["ctx1"]
    entry = lambda: next(s for s in ctx_status(orch)["servers"] if s["url"] == old.url)  # noqa: E731
    old_epoch = entry()["kv_index"]["epoch"]
    assert entry()["kv_index"]["blocks"] >= 10  # what the first test left there
    old.stop()
    wait_for(lambda: not (entry()["kv_index"] or {}).get("synced"), 15, "the broken stream to drop the index")
    cfg = topo.server_config("ctx", 1)
    cluster["ctx1"] = ThreadedUvicorn(create_server_app(build_inproc_state(cfg)), cfg.host, cfg.port).start()
    index = wait_for(lambda: (i := entry()["kv_index"]) and i["synced"] and i["epoch"] != old_epoch and i, 30,
                     "the restarted server's index")
    assert index["blocks"] == 0 and index["seq"] == 0
    prefix = [11 + (3 * i) % 400 for i in range(40)]  # the ctx1 prompt of the first test
    before = {s["url"]: s["served"] for s in ctx_status(orch)["servers"]}
    hits = ctx_status(orch)["kv_hits"]
    answer = complete(orch, prefix + [5, 5, 5])
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = ctx_status(orch)["kv_hits"]
    # nobody holds it now: predicted 0, and the server it went to reports 0 too (a fresh cache, or
    # ctx0 which never computed it)
    assert after["predicted_hit_tokens"] == hits["predicted_hit_tokens"]
    assert after["reported_hit_tokens"] == hits["reported_hit_tokens"]
    assert sum(s["served"] - before[s["url"]] for s in ctx_status(orch)["servers"]) == 1
