"""Abandoned work is dropped at once (issue 14.6): clients that leave during long prefills do not
delay the next request by more than one engine step, on ctx and gen servers and through the
orchestrator, stream or not.

Every engine step sleeps ``STEP_S`` first (``PDSERVE_TEST_STEP_DELAY_S``) and the step budget is
small, so one abandoned prompt would take ``STEPS_PER_PROMPT`` steps to prefill: if the N abandoned
prompts were still prefilled, the next short request would wait N × STEPS_PER_PROMPT steps
(~20 s) instead of at most one.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology

STEP_S = 0.5
BUDGET = 32                 # engine.max_num_tokens
PROMPT_WORDS = 200          # ~200 tokens: 7 steps of 32
N_CLIENTS = 6
LEAVE_AFTER_S = 0.5
SLACK_S = 0.75              # the client's own timing, the event loops, a loaded machine
SHORT = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow_cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    topo = write_topology(tmp_path_factory.mktemp("topo") / "slow.yaml", str(tiny_model_dir), TINY_NAME,
                          engine={"max_num_tokens": BUDGET, "num_kv_blocks": 1024})
    slow = {"PDSERVE_TEST_STEP_DELAY_S": str(STEP_S)}
    return Cluster(topo, procs).start(env={"ctx": slow, "gen": slow})


async def short_request(url: str) -> float:
    async with httpx.AsyncClient(timeout=120) as c:
        t0 = time.monotonic()
        r = await c.post(url + "/v1/completions", json=SHORT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        return time.monotonic() - t0


async def leave_early(url: str, stream: bool, i: int) -> None:
    body = {"model": TINY_NAME, "prompt": f"{i} " + "word " * PROMPT_WORDS, "max_tokens": 4, "temperature": 0,
            "stream": stream}
    async with httpx.AsyncClient(timeout=60) as c:
        with pytest.raises(TimeoutError):  # the prefill takes seconds: we leave before any answer
            async with asyncio.timeout(LEAVE_AFTER_S):
                await c.post(url + "/v1/completions", json=body)


def delay_after_abandoned(url: str, stream: bool) -> tuple[float, float]:
    """(the short request alone, the same right after N clients left during their prefills), seconds."""
    async def scenario() -> tuple[float, float]:
        alone = min([await short_request(url) for _ in range(2)])
        await asyncio.gather(*(leave_early(url, stream, i) for i in range(N_CLIENTS)))
        return alone, await short_request(url)

    return asyncio.run(scenario())


@pytest.mark.parametrize("target,stream", [("orchestrator", False), ("orchestrator", True),
                                           ("ctx", False), ("ctx", True), ("gen", False)])
def test_clients_that_leave_cost_at_most_one_step(slow_cluster, target, stream):
    url = slow_cluster.url if target == "orchestrator" else slow_cluster.server_url(target)
    alone, after = delay_after_abandoned(url, stream)
    print(f"{target} stream={stream}: short request alone {alone:.2f} s, after {N_CLIENTS} abandoned "
          f"{after:.2f} s (one step {STEP_S} s; undropped work would add ~{N_CLIENTS * 7 * STEP_S:.0f} s)")
    assert after <= alone + STEP_S + SLACK_S, (alone, after)
    for role in ("ctx", "gen"):  # nothing abandoned is left in either engine
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = httpx.get(slow_cluster.server_url(role) + "/server_info", timeout=10).json()
            if info["free_blocks"] == info["total_blocks"] and info.get("waiting_requests", 0) == 0:
                break
            time.sleep(0.2)
        assert info["free_blocks"] == info["total_blocks"] and info.get("waiting_requests", 0) == 0, (role, info)
