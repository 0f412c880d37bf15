"""schedule_style generation_first with real processes: the gen server's wait on the ctx server is
bounded by ``kv_transfer.ctx_wait_ms``, and a wait that runs out (or a client that leaves during it)
leaves every block free on both servers.

The ctx server here is slow on purpose: every engine step sleeps STEP_DELAY_S and a step prefills
at most 4 tokens, so a 3-token prompt parks after one step while a 64-token one needs 16 steps
(≥ 6.4 s), far past WAIT_MS.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology

STEP_DELAY_S = 0.4
WAIT_MS = 3000
SHORT = [17, 18, 19]
LONG = list(range(100, 164))


@pytest.fixture(scope="module")
def slow_ctx(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    path = write_topology(tmp_path_factory.mktemp("topo") / "genfirst.yaml", str(tiny_model_dir), TINY_NAME,
                          kv_transfer={"ctx_wait_ms": WAIT_MS},
                          orchestrator={"schedule_style": "generation_first", "max_retries": 0})
    doc = yaml.safe_load(path.read_text())
    doc["pools"]["ctx"]["engine"] = {"max_num_tokens": 4}
    path.write_text(yaml.safe_dump(doc))
    return Cluster(path, procs).start(env={"ctx": {"PDSERVE_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}})


def body(prompt: list[int], **kw) -> dict:
    return {"model": TINY_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def wait_settled(c: Cluster, start: dict[str, int], within_s: float) -> None:
    """Every server back at its start count of free blocks, no lease parked, no wait held."""
    deadline = time.monotonic() + within_s
    while True:
        now = {u: info(u) for u in start}
        if all(now[u]["free_blocks"] == n for u, n in start.items()) and \
                now[c.server_url("ctx")]["parked_leases"] == 0 and now[c.server_url("ctx")]["lease_waits"] == 0:
            return
        assert time.monotonic() < deadline, f"not settled after {within_s} s: {now}"
        time.sleep(0.1)


def servers(c: Cluster) -> list[str]:
    return [c.server_url("ctx"), c.server_url("gen")]


def test_a_slow_prefill_within_the_wait_equals_colocated(slow_ctx):
    for stream in (False, True):
        r = httpx.post(slow_ctx.url + "/v1/completions", json=body(SHORT, stream=stream), timeout=60)
        assert r.status_code == 200, r.text
    got = httpx.post(slow_ctx.url + "/v1/completions", json=body(SHORT), timeout=60).json()["choices"][0]
    want = httpx.post(slow_ctx.server_url("gen") + "/v1/completions", json=body(SHORT), timeout=60).json()["choices"][0]
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])


def test_wait_past_ctx_wait_ms_is_a_clear_504_and_frees_both_servers(slow_ctx):
    start = {u: info(u)["free_blocks"] for u in servers(slow_ctx)}
    t0 = time.monotonic()
    r = httpx.post(slow_ctx.url + "/v1/completions", json=body(LONG), timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout" and "ctx_wait_ms" in err["message"], err
    assert WAIT_MS / 1000 - 0.2 < took < WAIT_MS / 1000 + 4.0  # bounded by the wait, not the 6.4 s prefill
    wait_settled(slow_ctx, start, within_s=3 * STEP_DELAY_S + 3)


def test_client_gone_during_the_wait_frees_both_servers(slow_ctx):
    start = {u: info(u)["free_blocks"] for u in servers(slow_ctx)}

    async def leave_early():
        async with httpx.AsyncClient(timeout=30) as client:
            # Nothing is answered before the first token; leave after 1 s (the ctx server is
            # prefilling, the gen server waiting): the connection closes.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(slow_ctx.url + "/v1/completions", json=body(LONG, stream=True)), 1.0)

    asyncio.run(leave_early())
    wait_settled(slow_ctx, start, within_s=3 * STEP_DELAY_S + 3)
    r = httpx.post(slow_ctx.url + "/v1/completions", json=body(SHORT), timeout=60)
    assert r.status_code == 200, r.text  # and the servers serve on
