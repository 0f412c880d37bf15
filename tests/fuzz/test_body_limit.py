"""The body size limit, in-process on every server kind: over it → 413 (``Connection: close``), at
it → served. The limit must exceed the largest valid request, so a valid body padded with JSON
whitespace to exactly MAX_BODY_BYTES is answered."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdserve.request_body import MAX_BODY_BYTES
from tests.fuzz.bodies import KINDS, completion_body, dumps
from tests.fuzz.harness import error_problem
from tests.fuzz.inproc import MODEL, wait_ready
from tests.fuzz.test_fuzz_in_process import asgi_client


def run_on(cluster, kind: str, scenario):
    app = cluster.apps[kind]

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            if kind == "orchestrator":
                await stack.enter_async_context(app.router.lifespan_context(app))
            client = await stack.enter_async_context(asgi_client(app))
            await wait_ready(client)
            return await scenario(client)

    return asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_body_over_the_limit_is_413_and_at_the_limit_is_served(inproc_cluster, kind):
    body = dumps(completion_body(MODEL))
    at_limit = body[:-1] + b" " * (MAX_BODY_BYTES - len(body)) + b"}"
    assert len(at_limit) == MAX_BODY_BYTES

    async def chunks(data: bytes, size: int = 1 << 20):  # no Content-Length: chunked upload
        for i in range(0, len(data), size):
            yield data[i:i + size]

    async def scenario(client):
        over = await client.post("/v1/completions", content=at_limit + b" ", headers={"content-type": "application/json"})
        chunked = await client.post("/v1/completions", content=chunks(at_limit + b" "))
        ok = await client.post("/v1/completions", content=at_limit, headers={"content-type": "application/json"})
        return over, chunked, ok

    over, chunked, ok = run_on(inproc_cluster, kind, scenario)
    for r in (over, chunked):
        assert r.status_code == 413 and error_problem(r.content) is None, r.text
        assert r.headers["connection"] == "close" and str(MAX_BODY_BYTES) in r.json()["error"]["message"]
    assert ok.status_code == 200, ok.text[:300]
    assert ok.json()["usage"]["completion_tokens"] == 2
