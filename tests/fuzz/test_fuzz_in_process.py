"""The generated bad-input fuzz, 1,000 cases per server kind, in-process through each ASGI app.

Asserts for every case: no 5xx, the OpenAI error shape on every 4xx, no hang, a refused body where
the body is invalid and an answer where it is valid; every 100 cases a greedy request answers
exactly as before, and at the end the server's KV pool is back to where it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from tests.fuzz.bodies import CLASSES, KINDS, generate
from tests.fuzz.harness import Answer, run_cases
from tests.fuzz.inproc import MODEL, wait_ready

N_CASES = 1000
SEED = 20261201


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://fuzz", timeout=30)


async def free_blocks(client: httpx.AsyncClient) -> int:
    return (await client.get("/server_info")).json()["free_blocks"]


async def settle(client: httpx.AsyncClient, want: int, timeout_s: float = 10.0) -> int:
    """Wait (bounded) until the server reports ``want`` free KV blocks; returns the last count."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (got := await free_blocks(client)) != want and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_bodies_in_process(inproc_cluster, kind):
    app = inproc_cluster.apps[kind]

    async def scenario():
        async with contextlib.AsyncExitStack() as stack:
            if kind == "orchestrator":  # the server apps' engines run for the whole module
                await stack.enter_async_context(app.router.lifespan_context(app))
            client = await stack.enter_async_context(asgi_client(app))
            await wait_ready(client)
            servers = {role: await stack.enter_async_context(asgi_client(inproc_cluster.apps[role]))
                       for role in ("ctx", "gen")}
            before = {role: await free_blocks(c) for role, c in servers.items()}
            state = inproc_cluster.states["gen"]

            async def send(path: str, body: bytes, headers: dict[str, str]) -> Answer:
                r = await client.post(path, content=body, headers=headers)
                return Answer(r.status_code, dict(r.headers), r.content)

            async def release_lease(case, answer: Answer) -> None:
                if kind != "ctx" or answer.status != 200 or b"ctx_request_id" not in answer.body:
                    return
                params = json.loads(answer.body)["choices"][0].get("disaggregated_params") or {}
                if params.get("ctx_request_id"):
                    await client.post("/disagg/release", json={"ctx_request_id": params["ctx_request_id"]})

            cases = generate(kind, N_CASES, SEED, model=MODEL, vocab_size=state.vocab_size,
                             kv_layout=state.kv_layout.model_dump())
            report = await run_cases(send, cases, MODEL, after=release_lease)
            after = {role: await settle(c, before[role]) for role, c in servers.items()}
            return cases, report, before, after

    cases, report, before, after = asyncio.run(scenario())
    assert not report.failures, report.summary()
    assert {c.cls for c in cases} == set(CLASSES)
    assert report.statuses.get(200, 0) >= 100 and sum(n for s, n in report.statuses.items() if s >= 400) >= 600
    assert after == before, f"KV blocks not back: before {before}, after {after}"
