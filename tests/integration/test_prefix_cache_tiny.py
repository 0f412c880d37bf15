"""Prefix caching with real processes (tiny random Llama, block_size 4, 1 ctx + 1 gen + orchestrator):
cached answers equal uncached ones, ``usage.prompt_tokens_details.cached_tokens`` reports the hit on
every path, counters and ``POST /reset_prefix_cache`` (admin token) work.

An uncached reference is a request with a fresh ``cache_salt``: a salt nobody used before can never
hit a block, so it runs exactly as with ``enable_prefix_caching: false``."""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology
from tests.integration.test_disagg_tiny import chat_body, completion_body, run

TOKEN = "prefix-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BS = 4
SYSTEM = "You are a careful assistant. Answer briefly, in plain words, and never invent facts. " * 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    topo = write_topology(tmp_path_factory.mktemp("topo") / "prefix.yaml", str(tiny_model_dir), TINY_NAME)
    with pytest.MonkeyPatch.context() as mp:  # every process (servers, orchestrator) inherits the token
        mp.setenv("PDSERVE_ADMIN_TOKEN", TOKEN)
        return Cluster(topo, procs).start()


def fresh_salt() -> str:
    return uuid.uuid4().hex


def body_for(path: str, text: str, stream: bool, **kw) -> dict:
    return chat_body(text, stream, **kw) if "chat" in path else completion_body(text, stream, **kw)


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def expected_hit(prompt_tokens: int) -> int:
    """Full blocks of the prompt minus one token: the last prompt token is always computed."""
    return (prompt_tokens - 1) // BS * BS


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cached_answers_equal_uncached_on_every_path(cluster, path, stream):
    salt = fresh_salt()
    text = SYSTEM + f"Question {path} {stream}: what is a prefix cache?"
    reference = run(cluster.url, path, body_for(path, text, stream, cache_salt=fresh_salt()))
    first = run(cluster.url, path, body_for(path, text, stream, cache_salt=salt))
    second = run(cluster.url, path, body_for(path, text, stream, cache_salt=salt))  # ctx cache hit
    colocated = run(cluster.server_url("gen"), path, body_for(path, text, stream, cache_salt=salt))  # gen cache
    p = reference[2]["prompt_tokens"]
    assert p > 8 * BS
    assert cached(reference[2]) == cached(first[2]) == 0
    assert cached(second[2]) == expected_hit(p)
    assert cached(colocated[2]) == expected_hit(p)   # the pulled blocks joined the gen server's cache
    for answer in (first, second, colocated):
        assert answer[:2] == reference[:2]
        assert {k: answer[2][k] for k in ("prompt_tokens", "completion_tokens")} == \
            {k: reference[2][k] for k in ("prompt_tokens", "completion_tokens")}


@pytest.mark.parametrize("plen", [3 * BS, 3 * BS + 1])
def test_block_boundary_prompts(cluster, plen):
    salt = fresh_salt()
    prompt = [7 + 11 * i for i in range(plen)]
    reference = run(cluster.url, "/v1/completions", completion_body(prompt, False, cache_salt=fresh_salt()))
    run(cluster.url, "/v1/completions", completion_body(prompt, False, cache_salt=salt))
    again = run(cluster.url, "/v1/completions", completion_body(prompt, False, cache_salt=salt))
    assert again[:2] == reference[:2]
    assert cached(again[2]) == (2 * BS if plen == 3 * BS else 3 * BS)


def test_concurrent_requests_sharing_a_prefix(cluster):
    shared = [5 + 3 * i for i in range(41)]                   # 10 full blocks + 1 token
    prompts = [shared + [700 + i, 800 + i, 900 + i] for i in range(6)]
    alone = [run(cluster.url, "/v1/completions", completion_body(p, False, cache_salt=fresh_salt())) for p in prompts]
    salt = fresh_salt()
    run(cluster.url, "/v1/completions", completion_body(shared, False, cache_salt=salt))  # warm the shared head
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: run(cluster.url, "/v1/completions",
                                               completion_body(p, False, cache_salt=salt)), prompts))
    for a, t in zip(alone, together):
        assert t[:2] == a[:2]
        assert cached(t[2]) == 40   # block 10 holds shared[40] and each request's own tokens


def metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).rsplit(" ", 1)[1])


def wait_all_free(url: str, timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(url + "/server_info", timeout=10).json()
        if info["free_blocks"] == info["total_blocks"] or time.monotonic() > deadline:
            return info


def test_counters_free_blocks_and_reset(cluster):
    text = SYSTEM + "Counters?"
    salt = fresh_salt()
    for _ in range(2):
        run(cluster.url, "/v1/completions", completion_body(text, False, cache_salt=salt))
    ctx = cluster.server_url("ctx")
    info = wait_all_free(ctx)
    assert info["free_blocks"] == info["total_blocks"] and info["cached_blocks"] > 0  # cached blocks are free
    m = httpx.get(ctx + "/metrics", timeout=10).text
    assert metric(m, "pdserve_prefix_cache_hits_total") > 0
    assert metric(m, "pdserve_prefix_cache_queries_total") >= metric(m, "pdserve_prefix_cache_hits_total")
    assert metric(m, "pdserve_kv_cache_cached_blocks") == info["cached_blocks"]
    assert metric(m, "pdserve_kv_cache_free_blocks") == info["total_blocks"]
    # Servers: admin token required; the answer counts the freed blocks.
    assert httpx.post(ctx + "/reset_prefix_cache", timeout=10).status_code == 401
    r = httpx.post(ctx + "/reset_prefix_cache", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["freed_blocks"] == info["cached_blocks"]
    assert httpx.get(ctx + "/server_info", timeout=10).json()["cached_blocks"] == 0
    after = run(cluster.url, "/v1/completions", completion_body(text, False, cache_salt=salt))
    assert cached(after[2]) == 0
    # The orchestrator fans out to both servers.
    assert httpx.post(cluster.url + "/reset_prefix_cache", timeout=10).status_code == 401
    r = httpx.post(cluster.url + "/reset_prefix_cache", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert sorted(r.json()["servers"]) == sorted([ctx, cluster.server_url("gen")])
    assert all(v["freed_blocks"] > 0 for v in r.json()["servers"].values())
    assert os.environ.get("PDSERVE_ADMIN_TOKEN") != TOKEN   # the token stayed with the cluster's processes
