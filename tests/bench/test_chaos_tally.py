"""bench/_chaos.py's bookkeeping: what counts as completed, identical, failed and hung, and how a
chaos SSE stream is read (an error event, a stream cut without a finish reason)."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench._chaos import Outcome, stream_chat, tally


def test_every_request_is_exactly_one_of_completed_failed_hung():
    outs = [Outcome(0, "ab", "length"), Outcome(1, "x", "length"), Outcome(0, "a", None, "engine is dead"),
            Outcome(1, "", None, None, 31.0, True)]
    counts = tally(outs, refs=["ab", "xy"])
    assert (counts["completed"], counts["identical"], counts["failed"], counts["hung"]) == (2, 1, 1, 1)
    assert counts["slowest_s"] == 31.0 and counts["errors"] == ["engine is dead"]


def _sse(events: list[dict | str]) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _read(body: bytes) -> Outcome:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go() -> Outcome:
        out = Outcome(0)
        async with httpx.AsyncClient(transport=transport) as client:
            await stream_chat(client, "http://x", {}, out)
        return out

    return asyncio.run(go())


def chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def test_stream_text_finish_and_error_events():
    ok = _read(_sse([chunk("Hel"), chunk("lo", "length"), "[DONE]"]))
    assert (ok.text, ok.finish, ok.error, ok.completed) == ("Hello", "length", None, True)
    broken = _read(_sse([chunk("Hel"), {"error": {"message": "generation stream broke"}}, "[DONE]"]))
    assert broken.error == "generation stream broke" and not broken.completed
    cut = _read(_sse([chunk("Hel")]))
    assert cut.error == "the stream ended without a finish reason" and not cut.completed
