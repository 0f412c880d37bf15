"""A server echoes the orchestrator's X-Request-Id and its log lines for the request carry it."""

from __future__ import annotations

import asyncio
import logging

from executor.http_server import FrontendHeader
from pdserve.request_id import RequestIdFilter


def call(app, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(FrontendHeader(app, frontend_id=3)(scope, receive, send))
    return sent[0]["headers"]


def test_request_id_echoed_and_stamped_on_log_lines(caplog):
    log = logging.getLogger("executor.test_echo")
    caplog.handler.addFilter(RequestIdFilter(prefix=True))

    async def app(scope, receive, send):
        log.warning("working on it")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with caplog.at_level(logging.WARNING, logger="executor.test_echo"):
        headers = call(app, [(b"x-request-id", b"rid-7")])
        assert (b"x-request-id", b"rid-7") in headers and (b"x-pdserve-frontend", b"3") in headers
        assert caplog.records[-1].getMessage() == "[rid-7] working on it"
        headers = call(app, [(b"x-request-id", b"bad id")])  # unsafe: neither echoed nor logged
        assert not any(k == b"x-request-id" for k, _ in headers)
        assert caplog.records[-1].getMessage() == "working on it"
