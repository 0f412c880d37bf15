"""SIGTERM asks the orchestrator how to drain; anything but a clear ``move_kv`` means wait."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from executor.drain_advice import DrainAdvisor

SELF = "http://127.0.0.1:7001"


def ask(answer: httpx.Response | Exception, member: bool = True,
        token: bool = False) -> tuple[str, str, list[httpx.Request]]:
    """(mode, reason, requests the orchestrator got) for one SIGTERM whose notice gets ``answer``."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if isinstance(answer, Exception):
            raise answer
        return answer

    env = "DRAIN_TEST_TOKEN" if token else "DRAIN_TEST_NO_TOKEN"
    advisor = DrainAdvisor("http://orch:8000/", SELF, env, lambda: member, transport=httpx.MockTransport(handler))
    advice = asyncio.run(advisor.ask())
    return advice.mode, advice.reason, seen


def test_move_kv_when_the_orchestrator_answers_it(monkeypatch):
    monkeypatch.setenv("DRAIN_TEST_TOKEN", "s3cret")
    mode, reason, seen = ask(httpx.Response(200, json={"mode": "move_kv", "reason": "g1 is ready"}), token=True)
    assert (mode, reason) == ("move_kv", "g1 is ready")
    (req,) = seen
    assert str(req.url) == "http://orch:8000/cluster/workers/drain" and json.loads(req.content) == {"url": SELF}
    assert req.headers["authorization"] == "Bearer s3cret"  # the admin token, as its registration


@pytest.mark.parametrize("answer,why", [
    (httpx.Response(200, json={"mode": "wait", "reason": "no other gen server is ready"}), "no other gen server"),
    (httpx.Response(404, json={"error": {"message": "no member"}}), "HTTP 404"),
    (httpx.Response(200, json={"mode": "teleport"}), "HTTP 200"),
    (httpx.Response(200, text="not json"), "HTTP 200"),
    (httpx.ConnectError("refused"), "did not answer: ConnectError"),
])
def test_anything_else_means_wait(answer, why):
    mode, reason, _ = ask(answer)
    assert mode == "wait" and why in reason, reason


def test_a_server_that_never_registered_asks_nobody():
    mode, reason, seen = ask(httpx.Response(200, json={"mode": "move_kv"}), member=False)
    assert mode == "wait" and seen == [] and "not a member" in reason
