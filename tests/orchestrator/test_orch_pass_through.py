"""Pass-through gen streams (``disaggregated_params.relay_head``): chunks whose text follows the
client's go out as the server wrote them; the rest is merged as any event (no network: scripted
gen streams)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from orchestrator.metrics import Metrics
from orchestrator.pools import Server, ServerState
from orchestrator.progress import Progress
from orchestrator.relay import GenRelay, GenStream, StreamAnswer
from pdserve.protocol import RELAY_LINE
from test_orch_progress import ctx_answer
from test_orch_relay_writes import ScriptedStream

HEAD = {"id": "cmpl-orch", "created": 11}


def passed(text: str, start: int, ids: list[int], finish: str | None = None, chunk: bool = True) -> bytes:
    """A pass-through event as a pdserve gen server writes it (completions)."""
    record = RELAY_LINE + json.dumps([start, start + len(text), ids, finish]).encode() + b"\n"
    if not chunk:
        return record + b"\n"
    doc = {"id": HEAD["id"], "object": "text_completion", "created": HEAD["created"], "model": "m",
           "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": None}
    return record + b"data: " + json.dumps(doc).encode() + b"\n\n"


class Streams:
    """A GenSource handing out scripted streams in order: the first, then one per migration."""

    def __init__(self, *scripts: list[bytes]) -> None:
        self.streams = [GenStream(Server("gen", i, f"http://g{i}", state=ServerState.READY), ScriptedStream(s))
                        for i, s in enumerate(scripts)]
        self.migrated_with: list[list[int]] = []
        self.abandoned = False

    async def first(self) -> GenStream:
        return self._next()

    async def migrate(self, progress: Progress) -> GenStream:
        self.migrated_with.append(list(progress.token_ids))
        return self._next()

    def _next(self) -> GenStream:
        gs = self.streams[len(self.migrated_with)]
        gs.server.in_flight = 1
        return gs

    def abandon(self) -> None:
        self.abandoned = True


def relay_to_client(source: Streams, ctx_text: str = " a", migration_limit: int = 1) -> tuple[bytes, GenRelay]:
    """The client's SSE body after the ctx answer ``ctx_text`` (token 1), and the relay."""
    writes, relay = client_writes(source, ctx_text, migration_limit)
    return b"".join(writes), relay


def client_writes(source: Streams, ctx_text: str = " a", migration_limit: int = 1) -> tuple[list[bytes], GenRelay]:
    """:func:`relay_to_client`, one body message per item."""
    progress = Progress.for_body({"prompt": "x"}, chat=False)
    first = progress.take_ctx_answer(ctx_answer(ctx_text, False, first=[1]), HEAD)
    metrics = Metrics()
    relay = GenRelay(progress, source, migration_limit, metrics, "/v1/completions", time.monotonic() + 60,
                     include_usage=False)
    head = b"data: " + json.dumps(progress.first_chunk(first)).encode() + b"\n\n"
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    async def receive() -> dict:
        raise AssertionError("the stream never reads the request")

    asyncio.run(StreamAnswer(relay, source, head, 0.0, metrics, "/v1/completions")({"type": "http"}, receive, send))
    return sent, relay


def client_events(body: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for block in body.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: "), block  # no record line reaches the client
            out.append("[DONE]" if block == b"data: [DONE]" else json.loads(block[6:]))
    return out


def text_of(events: list[dict | str]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def test_chunks_after_the_first_token_pass_as_the_server_wrote_them():
    later = [passed(" b", 2, [2]), passed(" c", 4, [3]), passed("", 6, [], "length")]
    body, relay = relay_to_client(Streams([passed(" a", 0, [1]), *later, b"data: [DONE]\n\n"]))
    for event in later:  # byte for byte, the record cut off
        assert event[event.index(b"\n") + 1:] in body
    events = client_events(body)
    assert text_of(events) == " a b c" and events[-1] == "[DONE]"
    assert {e["id"] for e in events if isinstance(e, dict)} == {HEAD["id"]}
    assert relay.finished and relay.progress.token_ids == [1, 2, 3] and relay.progress.finish_reason == "length"
    assert relay.progress.sent_len == 6


def test_a_record_alone_carries_held_back_tokens():
    script = [passed(" a", 0, [1]), passed("", 2, [2], chunk=False), passed(" bc", 2, [3]), passed("", 5, [], "stop"),
              b"data: [DONE]\n\n"]
    body, relay = relay_to_client(Streams(script))
    assert text_of(client_events(body)) == " a bc" and relay.progress.token_ids == [1, 2, 3]


def test_a_first_chunk_holding_more_than_the_ctx_token_is_cut_to_the_new_text():
    script = [passed(" a b", 0, [1, 2]), passed("", 4, [], "length"), b"data: [DONE]\n\n"]
    body, relay = relay_to_client(Streams(script))
    events = client_events(body)
    assert text_of(events) == " a b" and [e["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert "token_ids" not in events[1]["choices"][0] and relay.progress.token_ids == [1, 2]


def test_a_migration_replaying_the_text_sends_only_what_the_client_lacks():
    broken = [passed(" a", 0, [1]), passed(" b", 2, [2])]  # then the connection drops (no [DONE])
    target = [passed(" a b", 0, [1, 2]), passed(" c", 4, [3]), passed("", 6, [], "length"), b"data: [DONE]\n\n"]
    source = Streams(broken, target)
    body, relay = relay_to_client(source)
    assert source.migrated_with == [[1, 2]] and relay.migrations == 1
    assert text_of(client_events(body)) == " a b c" and relay.progress.token_ids == [1, 2, 3]


@pytest.mark.parametrize("bad", [
    RELAY_LINE + b"[0, 2]\n\n",                                   # not four fields
    RELAY_LINE + b'[0, "2", [1], null]\n\n',                      # an offset that is no int
    RELAY_LINE + b"[0, 2, [1], null]\n\n",                        # text without its chunk
    RELAY_LINE + b"not json\n\n",
    passed(" b", 5, [2]),                                         # does not follow the stream's text
])
def test_a_bad_pass_through_event_ends_the_stream_with_an_error_not_a_migration(bad):
    source = Streams([passed(" a", 0, [1]), bad, passed("", 2, [], "length"), b"data: [DONE]\n\n"])
    body, relay = relay_to_client(source)
    events = client_events(body)
    assert events[-1] == "[DONE]" and "pass-through event" in events[-2]["error"]["message"]
    assert relay.migrations == 0 and source.abandoned


def test_the_relay_counts_passed_and_merged_events():
    script = [passed(" a", 0, [1]), passed(" b", 2, [2]), passed("", 4, [], "length"), b"data: [DONE]\n\n"]
    _, relay = relay_to_client(Streams(script))
    assert (relay.events, relay.passed) == (3, 2)  # the first one overlapped the ctx token: merged
    text = relay._metrics.registry.get_sample_value
    assert text("pdserve_orchestrator_relayed_events_total", {"how": "passed"}) == 2
    assert text("pdserve_orchestrator_relayed_events_total", {"how": "merged"}) == 1
