"""``create_app(transport=...)``: the hot path goes through the given httpx transport too (tests
that reach servers in-process, without sockets), streams and JSON alike."""

from __future__ import annotations

import asyncio
import json

import httpx

from orch_fakes import Behavior, Record, make_fake_server
from conftest import make_topology
from orchestrator.app import create_app
from test_orch_flow import COMPLETION


class Routes(httpx.AsyncBaseTransport):
    """Sends each request to the in-process ASGI app of its host:port."""

    def __init__(self, apps: dict[str, object]) -> None:
        self._transports = {netloc: httpx.ASGITransport(app) for netloc, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transports[f"{request.url.host}:{request.url.port}"].handle_async_request(request)


def test_requests_reach_in_process_servers_through_the_transport():
    ctx_rec, gen_rec = Record(), Record()
    apps = {"127.0.0.1:1001": make_fake_server("ctx", Behavior(), ctx_rec),
            "127.0.0.1:1002": make_fake_server("gen", Behavior(), gen_rec)}
    app = create_app(make_topology([1001], [1002], 1000), transport=Routes(apps))

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://orch")
            for _ in range(100):
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            plain = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "rid-t"})
            stream = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
            await client.aclose()
            return plain, stream

    plain, stream = asyncio.run(asyncio.wait_for(main(), 30))
    assert plain.status_code == 200 and json.loads(plain.content)["choices"][0]["text"]
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    assert len(ctx_rec.bodies) == 2 and len(gen_rec.bodies) == 2
    assert ctx_rec.request_ids[0] == "rid-t" and gen_rec.request_ids[0] == "rid-t"
