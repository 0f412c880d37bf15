"""A launched server's exit wakes the fleet at once (pidfd), and its replacement is admitted at its
registration: the two waits a restart no longer pays (issue 14's restart goal)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx

from orch_fakes import MODEL
from orchestrator.exit_watch import ExitWatch
from test_orch_failures import wait_for


def test_the_callback_runs_when_the_process_exits_not_before():
    async def scenario() -> tuple[float, bool]:
        watch, fired = ExitWatch(), asyncio.Event()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        t0 = time.monotonic()
        assert watch.watch(proc.pid, fired.set)
        await asyncio.sleep(0.2)
        early = fired.is_set()
        await asyncio.wait_for(fired.wait(), 10)
        proc.wait(5)
        watch.close()
        return time.monotonic() - t0, early

    elapsed, early = asyncio.run(scenario())
    assert not early and elapsed < 5.0, (early, elapsed)


def test_a_process_already_reaped_cannot_be_watched():
    async def scenario() -> bool:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait(10)
        return ExitWatch().watch(proc.pid, lambda: None)

    assert asyncio.run(scenario()) is False


def register(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/cluster/workers", json=body, timeout=5)


def test_a_new_process_at_a_failed_address_is_admitted_by_its_registration(make_cluster):
    c = make_cluster(n_gen=1, health_failure_threshold=10**6)  # never dropped for its failed polls
    sick = c.gen[0].server.url.replace("127.0.0.1", "localhost")  # a registered alias of the fake gen server
    c.gen[0].behavior.health_status = 503  # every poll fails from now on
    body = {"role": "gen", "url": sick, "model": MODEL, "state": "serving", "pid": 100}
    assert register(c.url, body).status_code == 200

    def state() -> str:
        servers = httpx.get(c.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"]
        return next(s["state"] for s in servers if s["url"] == sick)

    wait_for(lambda: state() == "unhealthy")
    assert register(c.url, body).json()["state"] == "unhealthy"  # the same process: its failed polls count
    assert register(c.url, {**body, "pid": 101}).json()["state"] == "ready"  # a new process: admitted now
