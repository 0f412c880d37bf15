"""The in-process executor: streams, abort, and the sticky engine-dead state."""

from __future__ import annotations

import asyncio

import pytest

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams
from executor.engine_client import EngineDeadError, EngineNotServingError, EngineState
from executor.inproc_executor import InProcessExecutor
from pdserve.config import EngineSettings


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineSettings(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, num_threads=1),
                     str(tiny_model_dir))


def req(rid: str, n: int = 8) -> EngineRequest:
    return EngineRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


async def collect(ex: InProcessExecutor, r: EngineRequest) -> list[int]:
    tokens = []
    async for out in ex.generate(r):
        tokens += out.new_token_ids
    return tokens


def test_generate_abort_and_dead_state(engine):
    async def scenario():
        ex = InProcessExecutor(engine)
        ex.start()
        free0 = engine.num_free_blocks
        assert len(await collect(ex, req("a"))) == 8
        # Closing a stream early aborts the request and frees its blocks.
        gen = ex.generate(req("b", 200))
        first = await gen.__anext__()
        assert isinstance(first, RequestOutput)
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if ex.stats()["free_blocks"] == free0:
                break
        assert ex.stats()["free_blocks"] == free0
        # A failing step makes the engine dead for good: pending and new requests fail at once.
        # In flight (its first output came) when the step breaks; a fixed sleep here let a fast run
        # finish the request first (flaky: "DID NOT RAISE").
        running = ex.generate(req("c", 10_000))
        assert isinstance(await running.__anext__(), RequestOutput)

        async def rest() -> None:
            async for _ in running:
                pass

        original = engine.step

        def broken_step():
            raise RuntimeError("simulated kernel failure")

        engine.step = broken_step
        pending = asyncio.create_task(rest())
        try:
            with pytest.raises(EngineDeadError, match="simulated kernel failure"):
                await asyncio.wait_for(pending, 2.0)
            assert ex.state == EngineState.DEAD
            with pytest.raises(EngineDeadError):
                await collect(ex, req("d"))
        finally:
            engine.step = original
            await ex.shutdown()

    asyncio.run(scenario())


def test_draining_refuses_new_requests(engine):
    async def scenario():
        ex = InProcessExecutor(engine)
        ex.start()
        ex.drain()
        with pytest.raises(EngineNotServingError, match="draining"):
            await collect(ex, req("e"))
        await ex.shutdown()

    asyncio.run(scenario())
