"""The engine loop's iteration clock (engine.step_timing) on both transports: iterations are
counted by the kind of step they ran, and an idle loop's moving clock is not a stats change."""

from __future__ import annotations

import asyncio
import time

import pytest

from executor.engine_loop import LOOP_STAGES
from tests.executor.fake_engine import Harness, collect, request


def run(kind: str, scenario) -> None:
    async def main():
        async with Harness(kind) as h:
            await asyncio.wait_for(scenario(h), 20)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["queue", "lanes"])
def test_iterations_are_counted_by_step_kind_and_idle(kind):
    async def scenario(h):
        t0 = time.perf_counter()
        await collect(h.client, request("clocked-1", n=5))
        await asyncio.sleep(0.15)  # at least one idle wait (idle_wait_s 0.1)
        stats = await h.client.fresh_stats()
        wall = time.perf_counter() - t0
        # The fake engine's steps report no kind ("empty"); one iteration per step, 5 tokens.
        assert stats["loop_empty_count"] >= 5
        assert stats["loop_idle_count"] >= 1 and stats["loop_idle_wait_s"] > 0.05
        spent = sum(stats.get(f"loop_{k}_{s}_s", 0.0) for k in ("empty", "idle") for s in LOOP_STAGES)
        assert spent <= wall + 0.5  # the loop started before t0 by at most the harness start-up

    run(kind, scenario)


@pytest.mark.parametrize("kind", ["queue", "lanes"])
def test_an_idle_loop_pushes_no_stats_snapshots(kind):
    async def scenario(h):
        await collect(h.client, request("clocked-2", n=2))
        await asyncio.sleep(0.4)  # the snapshot of the finished request's state has been pushed
        pushed = h.client.stats()  # the last snapshot the loop pushed
        await asyncio.sleep(0.8)  # > 3 stats periods of an idle loop whose clock keeps moving
        assert h.client.stats() == pushed
        fresh = await h.client.fresh_stats()  # asked for: the clock did move
        assert fresh["loop_idle_count"] > pushed.get("loop_idle_count", 0) + 3

    run(kind, scenario)
