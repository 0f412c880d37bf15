"""How a server process ends: dead engine → 75 after the grace; SIGTERM → drain → 0."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import uvicorn

from executor.engine_client import EngineState
from executor.drain_advice import DrainAdvice
from executor.lifecycle import ExitPolicy, LifecycleServer, ServerLifecycle, drain_summary, open_work
from pdserve.exit_codes import EXIT_ENGINE_DEAD, describe


class FakeClient:
    """The parts of an EngineClient the lifecycle reads; ``work`` is the engine's open requests."""

    def __init__(self) -> None:
        self.state = EngineState.SERVING
        self.dead_reason: str | None = None
        self.work = 0
        self.drains = 0
        self.moves = 0  # drain(move_kv=True) calls

    def drain(self, move_kv: bool = False) -> None:
        self.drains += 1
        self.moves += move_kv
        self.state = EngineState.DRAINING

    def stats(self) -> dict:
        return {"waiting_requests": self.work}

    async def fresh_stats(self) -> dict:
        return self.stats()


class FakeServer:
    should_exit = False


def run(lifecycle: ServerLifecycle, server: FakeServer, during, timeout_s: float = 5.0) -> float:
    """Run ``lifecycle.watch`` with ``during()`` (a coroutine) beside it; seconds until it ended."""
    async def scenario() -> float:
        t0 = time.monotonic()
        watch = asyncio.create_task(lifecycle.watch(server))
        await during()
        await asyncio.wait_for(watch, timeout_s)
        return time.monotonic() - t0

    return asyncio.run(scenario())


def test_a_dead_engine_answers_for_the_grace_then_exits_75():
    client, server = FakeClient(), FakeServer()
    life = ServerLifecycle(client, ExitPolicy(dead_exit_grace_s=0.3))

    async def die():
        await asyncio.sleep(0.2)
        assert not server.should_exit  # alive and serving before the death
        client.state, client.dead_reason = EngineState.DEAD, "worker rank 0 died"

    elapsed = run(life, server, die)
    assert server.should_exit and life.exit_code == EXIT_ENGINE_DEAD == 75
    assert 0.5 <= elapsed < 1.5, elapsed  # 0.2 s alive + 0.3 s grace (+ a poll)


def test_attached_frontends_do_not_exit_for_a_dead_engine():
    client, server = FakeClient(), FakeServer()
    life = ServerLifecycle(client, ExitPolicy(dead_exit_grace_s=0.0, exit_when_dead=False))

    async def die_then_stop():
        client.state = EngineState.DEAD
        await asyncio.sleep(0.5)
        assert not server.should_exit
        life.request_drain()  # frontend 0's exit SIGTERMs it

    run(life, server, die_then_stop)
    assert life.exit_code == 0


def test_sigterm_drains_waits_for_open_work_then_exits_0():
    client, server = FakeClient(), FakeServer()
    client.work = 2
    life = ServerLifecycle(client, ExitPolicy(drain_grace_s=5.0))

    async def finish_later():
        life.request_drain()
        await asyncio.sleep(0.5)
        assert client.state == EngineState.DRAINING and client.drains == 1 and not server.should_exit
        client.work = 0

    elapsed = run(life, server, finish_later)
    assert server.should_exit and life.exit_code == 0
    assert 0.5 <= elapsed < 1.5, elapsed


def test_sigterm_moves_kv_when_the_orchestrator_says_so_after_admission_stopped():
    client, server = FakeClient(), FakeServer()
    client.work = 3
    seen = []

    async def advisor() -> DrainAdvice:
        seen.append(client.state)  # asked only once nothing new is admitted
        return DrainAdvice("move_kv", "another gen server is ready")

    life = ServerLifecycle(client, ExitPolicy(drain_grace_s=5.0), advisor=advisor)

    async def moved_soon():
        life.request_drain()
        await asyncio.sleep(0.3)
        assert client.moves == 1 and not server.should_exit  # moved leases still wait for their pulls
        client.work = 0

    elapsed = run(life, server, moved_soon)
    assert seen == [EngineState.DRAINING] and life.drain_mode == "move_kv"
    assert server.should_exit and life.exit_code == 0 and elapsed < 1.5


@pytest.mark.parametrize("advisor", [None, "wait"])
def test_sigterm_waits_without_an_orchestrator_or_when_told_to(advisor):
    client, server = FakeClient(), FakeServer()

    async def says_wait() -> DrainAdvice:
        return DrainAdvice("wait", "no other gen server is ready to take its requests")

    life = ServerLifecycle(client, ExitPolicy(drain_grace_s=5.0), advisor=says_wait if advisor else None)

    async def sigterm():
        life.request_drain()

    run(life, server, sigterm)
    assert client.drains == 1 and client.moves == 0 and life.drain_mode == "wait" and life.exit_code == 0


def test_drain_summary_names_moves_bytes_tokens_and_blocks():
    line = drain_summary({"requests_moved": 6, "kv_moved_sent": {"bytes": 1234}, "tokens_computed": 99,
                          "free_blocks": 256, "total_blocks": 256})
    assert line == "moved 6 request(s), 1234 KV bytes sent; tokens computed 99; free blocks 256 of 256"


def test_drain_grace_bounds_the_wait():
    client, server = FakeClient(), FakeServer()
    client.work = 1  # never finishes
    life = ServerLifecycle(client, ExitPolicy(drain_grace_s=0.4))

    async def sigterm():
        life.request_drain()

    elapsed = run(life, server, sigterm)
    assert server.should_exit and life.exit_code == 0 and 0.4 <= elapsed < 1.5, elapsed


def test_open_work_counts_every_held_request():
    assert open_work({}) == 0
    assert open_work({"waiting_requests": 1, "scheduled_requests": 2, "pulling_requests": 3, "parked_requests": 4}) == 10
    assert open_work({"waiting_requests": 0, "running_requests": 3}) == 3  # rank 0's owners (outputs in flight)


def test_first_sigterm_drains_second_stops_and_neither_is_re_raised():
    life = ServerLifecycle(FakeClient(), ExitPolicy())
    server = LifecycleServer(uvicorn.Config(app=None), life)
    server.handle_exit(signal.SIGTERM, None)
    assert life.drain_requested and not server.should_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    assert server._captured_signals == []  # uvicorn would re-raise these and the process would die of it


def test_sigint_keeps_uvicorns_behaviour():
    server = LifecycleServer(uvicorn.Config(app=None), ServerLifecycle(FakeClient(), ExitPolicy()))
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server._captured_signals == [signal.SIGINT]


@pytest.mark.parametrize("code,text", [(75, "exit code 75 (engine dead)"), (3, "exit code 3 (start-up failed)"),
                                       (-9, "exit code -9 (killed by signal 9)"), (1, "exit code 1")])
def test_exit_codes_are_described(code, text):
    assert describe(code) == text
