"""Scale-down checks the server's answer to ``POST /admin/drain`` (issue 13.7)."""

from __future__ import annotations

import asyncio
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
