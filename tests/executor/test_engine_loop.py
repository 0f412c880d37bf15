"""The engine loop's ordering rules, on both transports (in-thread queue and zmq lanes).

Each rule of ``executor/engine_loop.py``'s docstring has a test here, run once per transport with
a scripted engine and role (``tests/executor/fake_engine.py``) behind the real EngineClient.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.errors import RequestValidationError
from engine.request import Phase, RequestOutput
from executor.engine_client import EngineDeadError, EngineNotServingError, EngineState
from executor.messages import Drain
from executor.phases import PhaseError
from tests.executor.fake_engine import Harness, Marker, collect, request

TRANSPORTS = ["queue", "lanes"]


def run(kind: str, scenario, idle_wait_s: float = 0.1) -> None:
    async def main():
        async with Harness(kind, idle_wait_s) as h:
            await asyncio.wait_for(scenario(h), 20)

    asyncio.run(main())


def tokens(items: list) -> list[int]:
    return [t for item in items if isinstance(item, RequestOutput) for t in item.new_token_ids]


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_items_arrive_in_order_and_the_final_output_ends_the_stream(kind):
    async def scenario(h):
        results = await asyncio.gather(*(collect(h.client, request(f"r{i}", n=5 + i)) for i in range(4)))
        for i, items in enumerate(results):
            assert tokens(items) == list(range(1, 6 + i))
            assert items[-1].finished and not any(x.finished for x in items[:-1])
        # Every engine call ran on one thread (the loop's): commands are applied between steps.
        assert len(h.engine.threads) == 1 and threading.get_ident() not in h.engine.threads

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_role_item_precedes_the_final_output(kind):
    async def scenario(h):
        items = await collect(h.client, request("ctx-1", n=3, phase=Phase.CONTEXT_ONLY))
        kinds = [type(x).__name__ for x in items]
        assert kinds == ["RequestOutput", "RequestOutput", "Marker", "RequestOutput"], kinds
        assert items[2] == Marker("ctx-1", "handoff") and items[-1].finished

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_kv_pull_item_then_outputs_and_an_error_item_ends_the_stream(kind):
    async def scenario(h):
        ok = await collect(h.client, request("gen-ok-1", n=2, phase=Phase.GENERATION_ONLY))
        assert ok[0] == Marker("gen-ok-1", "kv-done") and tokens(ok) == [1, 2] and ok[-1].finished
        seen = []
        with pytest.raises(PhaseError, match="KV pull failed") as err:
            async for item in h.client.generate(request("gen-fail-1", n=2, phase=Phase.GENERATION_ONLY)):
                seen.append(item)
        assert seen == [] and err.value.status == 502
        # The engine's own "abort" output for that request (after kv_ready(ok=False)) was dropped,
        # and the loop no longer counts it as running.
        await wait_stats(h, lambda s: s.get("running_requests") == 0)

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_abort_unknown_is_a_noop_and_abort_ends_a_running_request(kind):
    async def scenario(h):
        h.client.abort("no-such-request")
        assert tokens(await collect(h.client, request("after", n=2))) == [1, 2]
        gen = h.client.generate(request("long", n=10_000))
        first = await gen.__anext__()
        assert isinstance(first, RequestOutput) and not first.finished
        await gen.aclose()  # leaving early aborts it
        # The pushed snapshot may still be the one from before "long" was added (it is pushed at most
        # every 0.25 s), so wait for the engine to see the abort first, then for the loop to forget it.
        await wait_stats(h, lambda s: "long" in h.engine.aborted)
        await wait_stats(h, lambda s: s.get("running_requests") == 0)
        assert h.engine.aborted == ["no-such-request", "long"] and h.client.state == EngineState.SERVING

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_refused_add_fails_only_that_request(kind):
    async def scenario(h):
        good = asyncio.create_task(collect(h.client, request("good", n=20)))
        with pytest.raises(RequestValidationError, match="empty"):
            await collect(h.client, request("bad", prompt=()))
        assert tokens(await good) == list(range(1, 21))

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_drain_from_any_frontend_refuses_new_adds_and_lets_running_ones_finish(kind):
    async def scenario(h):
        running = asyncio.create_task(collect(h.client, request("in-flight", n=30)))
        await asyncio.sleep(0.05)
        h.client._send(Drain())  # as another frontend would: this client's own gate is still open
        await wait_stats(h, lambda s: s.get("state") == "draining")
        assert tokens(await running) == list(range(1, 31))

    async def refused(h):
        await scenario(h)
        h.client._requests.transition(EngineState.DRAINING, EngineState.SERVING)  # reach the loop's gate
        with pytest.raises(EngineNotServingError, match="draining"):
            await collect(h.client, request("late"))

    run(kind, refused)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_replies_and_stats_snapshots(kind):
    async def scenario(h):
        assert await h.client.release_lease("parked-1") is True
        assert await h.client.release_lease("other") is False
        fresh = await h.client.fresh_stats()
        assert fresh["total_blocks"] == 10 and fresh["role"] == "fake" and fresh["state"] == "serving"
        await wait_stats(h, lambda s: s.get("role") == "fake")  # the pushed snapshot carries it too

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_stalled_engine_waits_for_a_command_instead_of_spinning(kind):
    async def scenario(h):
        h.engine.hold = True  # the request waits "for blocks" while nothing runs
        task = asyncio.create_task(collect(h.client, request("waits", n=2)))
        await asyncio.sleep(0.2)
        steps0, t0 = h.engine.steps, time.monotonic()
        await asyncio.sleep(1.0)
        steps, elapsed = h.engine.steps - steps0, time.monotonic() - t0
        # One step per idle wait (0.5 s here) at most, not thousands of zero-timeout polls.
        assert steps <= elapsed / 0.5 + 2, f"{steps} steps in {elapsed:.2f} s while stalled"
        h.engine.hold = False
        t1 = time.monotonic()
        h.client.abort("nothing")  # any command ends the wait at once
        assert tokens(await task) == [1, 2]
        assert time.monotonic() - t1 < 0.4, "the stalled loop did not wake on a command"

    run(kind, scenario, idle_wait_s=0.5)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_stalled_engine_wakes_on_a_post(kind):
    async def scenario(h):
        h.engine.hold = True
        task = asyncio.create_task(collect(h.client, request("waits", n=2)))
        await asyncio.sleep(0.6)  # stalled: the loop sits in its 0.5 s waits

        def free_blocks(engine):
            engine.hold = False  # as a lease release frees blocks, from a role thread

        t1 = time.monotonic()
        threading.Thread(target=h.role.ops.post, args=(free_blocks,)).start()
        assert tokens(await task) == [1, 2]
        assert time.monotonic() - t1 < 0.4, "the stalled loop did not wake on a post"

    run(kind, scenario, idle_wait_s=0.5)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_failing_step_makes_the_engine_dead(kind):
    async def scenario(h):
        pending = asyncio.create_task(collect(h.client, request("doomed", n=10_000)))
        await asyncio.sleep(0.05)
        h.engine.fail_step = True
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await pending
        assert h.client.state == EngineState.DEAD and h.role.stopped
        with pytest.raises(EngineDeadError):
            await collect(h.client, request("after"))

    run(kind, scenario)


async def wait_stats(h, cond, timeout_s: float = 3.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = h.client.stats()
        if cond(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"stats never matched: {stats}")
        await asyncio.sleep(0.02)
