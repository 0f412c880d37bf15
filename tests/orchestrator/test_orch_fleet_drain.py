"""Scale-down checks the server's answer to ``POST /admin/drain`` (issue 13.7)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from orchestrator.fleet import Fleet, Instance
from orchestrator.pools import ClusterPools
from orchestrator.tasks import TaskOwner
from pdserve.config import parse_topology


class StopRecorder:
    kind = "local"

    def __init__(self) -> None:
        self.stopped: list[str] = []

    async def stop(self, inst: Instance, grace_s: float) -> None:
        self.stopped.append(inst.name)


def retire_with(answer: httpx.Response | Exception, caplog) -> tuple[bool, StopRecorder, list[httpx.Request]]:
    """Retire one idle gen member whose drain call gets ``answer``; (drain confirmed, backend, requests)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if isinstance(answer, Exception):
            raise answer
        return answer

    topology = parse_topology({"launcher": {"kind": "local"},
                               "pools": {"ctx": {"servers": [{"port": 0}]}, "gen": {"servers": [{"port": 0}]}}})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            pools, backend = ClusterPools.from_topology(topology), StopRecorder()
            fleet = Fleet(topology, pools, backend, client, TaskOwner())
            member = pools.gen.add("http://127.0.0.1:9", "managed", "abc")
            inst = Instance("gen", 0, instance_id="abc", url=member.url, handle=object())
            fleet.instances.append(inst)
            confirmed = await fleet._post_drain(member)
            fleet._retire(member, inst)
            await asyncio.wait_for(asyncio.gather(*fleet._tasks._tasks), 5)
            assert pools.gen.get(member.url) is None  # retired whatever the answer
            return confirmed, backend

    with caplog.at_level(logging.WARNING, logger="orchestrator.fleet"):
        confirmed, backend = asyncio.run(scenario())
    return confirmed, backend, seen


def test_a_confirmed_drain_is_accepted(caplog):
    confirmed, backend, seen = retire_with(httpx.Response(200, json={"state": "draining"}), caplog)
    assert confirmed and backend.stopped == ["gen#0"]
    assert [r.url.path for r in seen] == ["/admin/drain", "/admin/drain"]
    assert "did not confirm" not in caplog.text


@pytest.mark.parametrize("answer,logged", [
    (httpx.Response(404, json={"error": {"message": "Not Found"}}), "did not confirm the drain: HTTP 404"),
    (httpx.Response(200, json={"state": "serving"}), "did not confirm the drain: HTTP 200"),
    (httpx.Response(403, json={"error": {"message": "wrong token"}}), "HTTP 403"),
    (httpx.ConnectError("refused"), "POST /admin/drain failed: ConnectError"),
])
def test_an_unconfirmed_drain_is_logged_and_the_server_still_stopped(answer, logged, caplog):
    confirmed, backend, _ = retire_with(answer, caplog)
    assert not confirmed and backend.stopped == ["gen#0"]
    assert logged in caplog.text


def retire_gen(num_ready_others: int, caplog, orchestrator: dict | None = None) -> tuple[Instance, list[httpx.Request]]:
    """Retire one idle gen member while ``num_ready_others`` other gen servers are ready; the fake
    server confirms every drain and reports no lease. Returns (its instance, the requests sent to it)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"parked_leases": 0, "moved_leases": 0})
        return httpx.Response(200, json={"state": "draining"})

    topology = parse_topology({"launcher": {"kind": "local"}, "orchestrator": orchestrator or {},
                               "pools": {"ctx": {"servers": [{"port": 0}]}, "gen": {"servers": [{"port": 0}]}}})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            pools = ClusterPools.from_topology(topology)
            fleet = Fleet(topology, pools, StopRecorder(), client, TaskOwner())
            for s in list(pools.gen.servers):
                pools.gen.remove(s, "test")
            member = pools.gen.add("http://127.0.0.1:9", "managed", "abc")
            member.mark_ready()
            for i in range(num_ready_others):
                pools.gen.add(f"http://127.0.0.1:{10 + i}", "managed", f"o{i}").mark_ready()
            inst = Instance("gen", 0, instance_id="abc", url=member.url, handle=object())
            fleet.instances.append(inst)
            fleet._retire(member, inst)
            await asyncio.wait_for(asyncio.gather(*fleet._tasks._tasks), 5)
            return inst

    with caplog.at_level(logging.INFO, logger="orchestrator.fleet"):
        inst = asyncio.run(scenario())
    return inst, [r for r in seen if r.url.port == 9]


def test_scale_down_moves_kv_when_another_gen_server_is_ready(caplog):
    inst, seen = retire_gen(1, caplog)
    assert inst.drain_mode == "move_kv"
    # The drain is asked for first (its streams move at once), then its moved leases are awaited.
    assert [r.url.path for r in seen] == ["/admin/drain", "/server_info"]
    assert json.loads(seen[0].content) == {"mode": "move_kv"}
    assert "drained (move_kv)" in caplog.text


@pytest.mark.parametrize("others,orchestrator,why", [
    (0, None, "no other gen server is ready"),
    (1, {"migration_limit": 0}, "migration_limit is 0"),
    (1, {"drain_mode": "wait"}, None),
])
def test_scale_down_falls_back_to_waiting(others, orchestrator, why, caplog):
    inst, seen = retire_gen(others, caplog, orchestrator)
    assert inst.drain_mode == "wait"
    assert [r.url.path for r in seen] == ["/admin/drain"]  # after the wait for in-flight requests
    assert json.loads(seen[0].content) == {"mode": "wait"}
    if why is not None:
        assert f"drain_mode move_kv falls back to wait: {why}" in caplog.text
    assert "drained (wait)" in caplog.text
