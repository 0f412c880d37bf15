"""The relay's writes to the client: the chunks of one upstream piece leave in one body message, and
those that came with ``[DONE]`` leave with it (no network: a scripted gen stream)."""

from __future__ import annotations

import asyncio
import json
import time

from orchestrator.metrics import Metrics
from orchestrator.pools import Server, ServerState
from orchestrator.progress import Progress
from orchestrator.relay import GenRelay, GenStream, StreamAnswer


def event(text: str, finish: str | None = None, ids: list[int] | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if ids is not None:
        choice["token_ids"] = ids
    doc = {"id": "cmpl-gen", "object": "text_completion", "created": 7, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


class ScriptedStream:
    """The :class:`orchestrator.upstream.OpenStream` surface over fixed body pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.first_chunk, self._rest = pieces[0], list(pieces[1:])
        self.closed = False

    async def next_chunk(self) -> bytes | None:
        return self._rest.pop(0) if self._rest else None

    def expire(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class OneStream:
    def __init__(self, pieces: list[bytes]) -> None:
        server = Server("gen", 0, "http://g", state=ServerState.READY)
        server.in_flight = 1  # what open_gen_stream counted; the relay drops it
        self.gs = GenStream(server, ScriptedStream(pieces))
        self.abandoned = False

    async def first(self) -> GenStream:
        return self.gs

    async def migrate(self, progress):
        raise AssertionError("no migration expected")

    def abandon(self) -> None:
        self.abandoned = True


def answer(pieces: list[bytes]) -> tuple[list[dict], GenRelay, OneStream]:
    metrics, source = Metrics(), OneStream(pieces)
    relay = GenRelay(Progress.for_body({"prompt": "x"}, chat=False), source, 2, metrics, "/v1/completions",
                     time.monotonic() + 60, include_usage=False)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        raise AssertionError("the stream never reads the request")

    asyncio.run(StreamAnswer(relay, source, None, 0.0, metrics, "/v1/completions")({"type": "http"}, receive, send))
    return sent, relay, source


def test_one_write_per_upstream_piece_and_the_last_chunks_leave_with_done():
    pieces = [event(" a", ids=[1]) + event(" b", ids=[2]) + event(" c", ids=[3]),
              event(" d", ids=[4]) + event("", "length") + b"data: [DONE]\n\n"]
    sent, relay, source = answer(pieces)
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 2 and sent[-1]["more_body"] is False
    first = [json.loads(e[6:]) for e in bodies[0].split(b"\n\n") if e]
    assert [e["choices"][0]["text"] for e in first] == [" a", " b", " c"]
    assert all("token_ids" not in e["choices"][0] for e in first)      # the extension field is stripped
    assert bodies[1].endswith(b"data: [DONE]\n\n") and b'"text":" d"' in bodies[1]
    assert relay.chunks_sent == 5 and relay.progress.token_ids == [1, 2, 3, 4] and relay.finished
    assert relay.progress.text == " a b c d" and source.gs.stream.closed and not source.abandoned
    assert source.gs.server.in_flight == 0


def test_a_piece_per_event_is_still_one_write_per_event():
    pieces = [event(" a"), event(" b"), event("", "stop"), b"data: [DONE]\n\n"]
    sent, relay, _ = answer(pieces)
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 4 and bodies[-1] == b"data: [DONE]\n\n" and relay.chunks_sent == 3
