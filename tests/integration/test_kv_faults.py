"""KV transfer faults with real processes: nothing leaks a block, nothing hangs.

Every ctx server here holds each KV pull for PULL_DELAY_S before sending (a fault-injection hook),
which opens a reliable "mid-pull" window to kill a process or drop a client in.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology

PULL_DELAY_S = 1.5
LEASE_MS = 3000
TIMEOUT_MS = 4000


@pytest.fixture(scope="module")
def faults(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    topo = write_topology(tmp_path_factory.mktemp("topo") / "faults.yaml", str(tiny_model_dir), TINY_NAME,
                          num_ctx=2, num_gen=2, kv_transfer={"lease_ms": LEASE_MS, "timeout_ms": TIMEOUT_MS},
                          orchestrator={"max_retries": 0})
    return Cluster(topo, procs).start(env={"ctx": {"PDSERVE_TEST_KV_PULL_DELAY_S": str(PULL_DELAY_S)}})


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def free(url: str) -> int:
    return info(url)["free_blocks"]


def wait_free(url: str, want: int, within_s: float) -> float:
    """Seconds until ``url`` has ``want`` free blocks; fails after ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if free(url) == want:
            return time.monotonic() - t0
        time.sleep(0.05)
    pytest.fail(f"{url}: {free(url)} free blocks after {within_s} s, want {want}")


def body(**kw) -> dict:
    return {"model": TINY_NAME, "prompt": "one two three four five six seven eight nine ten eleven twelve",
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def park(ctx: str) -> dict:
    """Park the prompt on ctx under a fresh cache_salt: its block hashes are new to every gen
    server's prefix cache, so the gen request really pulls (no partial pull skips the faulted copy)."""
    salted = body(disaggregated_params={"request_type": "context_only"}, cache_salt=uuid.uuid4().hex)
    r = httpx.post(ctx + "/v1/completions", json=salted, timeout=30)
    assert r.status_code == 200, r.text
    params = r.json()["choices"][0]["disaggregated_params"]
    return {**params, "request_type": "generation_only"}


def all_urls(c: Cluster) -> list[str]:
    return [c.server_url(r, i) for r in ("ctx", "gen") for i in range(2)]


def test_client_disconnect_before_first_token_frees_everything(faults):
    start = {u: free(u) for u in all_urls(faults)}

    async def drop_early():
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", faults.url + "/v1/completions", json=body(stream=True)) as r:
                await asyncio.sleep(0.5)  # the pull is held PULL_DELAY_S: no token yet
                assert r.status_code == 200
            # leaving the block closes the connection before the first token

    for _ in range(2):  # round robin: both ctx/gen pairs
        asyncio.run(drop_early())
    for u, n in start.items():
        wait_free(u, n, PULL_DELAY_S + 3)
    t0 = time.monotonic()
    r = httpx.post(faults.url + "/v1/completions", json=body(), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert time.monotonic() - t0 < PULL_DELAY_S + 2.0  # only the injected hold, nothing left waiting


def test_client_gone_before_the_first_output_aborts_the_request(faults):
    """A gen request whose client leaves while its KV pull is held (no output yet) is aborted then:
    it never produces a first token (TTFT is not observed), and its blocks come back after the pull.
    (Runs before the tests that kill ctx 1 and gen 0.)"""
    gen = faults.server_url("gen", 0)
    start, ttft0 = free(gen), _metric(gen, 'pdserve_server_time_to_first_token_seconds_count{request_type="generation_only"}')
    params = park(faults.server_url("ctx", 0))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gen + "/v1/completions", json=body(disaggregated_params=params), timeout=0.5)  # during the pull
    wait_free(gen, start, PULL_DELAY_S + 2)
    time.sleep(0.5)
    ttft = _metric(gen, 'pdserve_server_time_to_first_token_seconds_count{request_type="generation_only"}')
    assert ttft == ttft0, "the abandoned request went on to its first token"


def test_100_faulted_requests_leave_full_pools(faults):
    urls = all_urls(faults)
    start = {u: free(u) for u in urls}
    ctx0, ctx1 = faults.server_url("ctx", 0), faults.server_url("ctx", 1)
    deadline = time.monotonic() + 120
    for i in range(100):
        assert time.monotonic() < deadline, f"only {i} faulted requests in 120 s"
        params = park(ctx0 if i % 2 else ctx1)
        if i % 3 == 0:  # abandoned: the orchestrator's cancel path
            r = httpx.post((ctx0 if i % 2 else ctx1) + "/disagg/release",
                           json={"ctx_request_id": params["ctx_request_id"]}, timeout=10)
            assert r.json() == {"released": True}
        elif i % 3 == 1:  # a gen request for a lease that was already released: refused cleanly
            httpx.post((ctx0 if i % 2 else ctx1) + "/disagg/release", json={"ctx_request_id": params["ctx_request_id"]})
            r = httpx.post(faults.server_url("gen", i % 2) + "/v1/completions", json=body(disaggregated_params=params),
                           timeout=30)
            assert r.status_code == 502 and "no KV lease" in r.json()["error"]["message"], r.text
        # i % 3 == 2: never pulled, never released: the lease timer frees it
    for u, n in start.items():
        wait_free(u, n, LEASE_MS / 1000 + 5)
    assert all(info(u).get("parked_leases", 0) == 0 for u in urls)


def test_ctx_killed_mid_pull_fails_within_timeout_and_frees_gen(faults):
    ctx, gen = faults.server_url("ctx", 1), faults.server_url("gen", 1)
    gen_start = free(gen)
    params = park(ctx)
    result: dict = {}

    def pull() -> None:
        t0 = time.monotonic()
        r = httpx.post(gen + "/v1/completions", json=body(disaggregated_params=params), timeout=30)
        result.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(0.5)  # the ctx side holds the pull
    (pid,) = [r["pid"] for r in info(ctx)["ranks"]]
    os.kill(pid, signal.SIGKILL)
    t.join(TIMEOUT_MS / 1000 + 10)
    assert not t.is_alive()
    assert result["status"] == 502, result
    assert "KV transfer failed" in result["body"]["error"]["message"]
    assert result["seconds"] < TIMEOUT_MS / 1000 + 2
    wait_free(gen, gen_start, 3)


def test_gen_killed_mid_pull_ctx_lease_frees_within_lease(faults):
    ctx, gen = faults.server_url("ctx", 0), faults.server_url("gen", 0)
    ctx_start = free(ctx)
    params = park(ctx)
    assert free(ctx) < ctx_start
    t_park = time.monotonic()

    def pull() -> None:
        try:
            httpx.post(gen + "/v1/completions", json=body(disaggregated_params=params), timeout=30)
        except httpx.HTTPError:
            pass  # the gen server is being killed

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(0.5)
    (pid,) = [r["pid"] for r in info(gen)["ranks"]]
    os.kill(pid, signal.SIGKILL)
    slack_s = 3  # scheduling on a loaded 2-core machine (6.6 s against 6.5 s was seen at load 9)
    wait_free(ctx, ctx_start, LEASE_MS / 1000 + PULL_DELAY_S + slack_s)
    assert time.monotonic() - t_park < LEASE_MS / 1000 + PULL_DELAY_S + slack_s
    t.join(10)


def _metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next((float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(prefix)), 0.0)
