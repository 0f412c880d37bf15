"""The generation phase of one request as the client sees it: one stream, whatever happens upstream.

:class:`GenRelay` reads gen streams (SSE) event by event, merges each into the request's
:class:`~orchestrator.progress.Progress` (so no text reaches the client twice or goes missing)
and, when a gen server dies mid-decode (the connection breaks, the stream ends without
``[DONE]``, or an in-band 5xx error event such as ``engine_dead``), asks its
:class:`GenSource` for a new stream that continues the request, up to
``orchestrator.migration_limit`` times. :class:`StreamAnswer` is the client's SSE response: the ctx
server's first token goes out at once, then the relay's chunks, then ``[DONE]``; a failure becomes
an error event (never a hang). A non-streaming request runs the same relay without a client
stream (``emit=None``) and answers the assembled JSON (:mod:`orchestrator.disagg`).

A pass-through stream (``disaggregated_params.relay_head``: a client's disaggregated stream of one
choice) carries a ``:pd`` record before each chunk (:data:`pdserve.protocol.RELAY_LINE`); a chunk
whose text follows the client's is forwarded as the server wrote it, unparsed (:meth:`GenRelay._passed`).

A gen server that drains with ``move_kv`` ends a movable stream with a ``moved`` event (the
request's KV parked there under a lease); the relay then asks its source to :meth:`GenSource.move`
the request: another gen server pulls that KV and decodes on from the next token. A move is not a
migration (nothing failed, nothing is recomputed): it does not count toward ``migration_limit``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.types import Receive, Scope, Send

from pdserve.protocol import RELAY_LINE, SSE_DONE

from . import jsonio
from .errors import OrchestratorError
from .h1client import UpstreamError
from .metrics import Metrics
from .pools import Server
from .progress import TOKEN_IDS_FIELD, Attempt, Progress
from .sse import EventSplitter, error_events
from .upstream import OpenStream, describe

log = logging.getLogger("orchestrator.relay")

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DEATH_TYPES = frozenset({"engine_dead", "service_unavailable", "internal_error"})

Emit = Callable[[bytes], Awaitable[None]]


@dataclass
class GenStream:
    """An open gen stream (first chunk arrived) and the server it runs on (whose ``in_flight``
    count it holds until the relay is done with it)."""

    server: Server
    stream: OpenStream
    predicted: int | None = None  # colocated: the prefix-cache hit the KV index predicted at pick time


class GenSource(Protocol):
    """Where a request's gen streams come from (:class:`orchestrator.migration.GenPhase`)."""

    async def first(self) -> GenStream:
        """The first gen stream. Raises OrchestratorError (every attempt failed, or a 4xx)."""

    async def migrate(self, progress: Progress) -> GenStream:
        """A new gen stream continuing from ``progress.token_ids``. Raises OrchestratorError."""

    async def move(self, progress: Progress, moved: dict, source: Server) -> GenStream:
        """A new gen stream on another gen server than ``source`` that pulls the KV ``source``
        parked (``moved``: its moved event's params) and decodes on. Raises OrchestratorError."""

    def abandon(self) -> None:
        """The request ends unfinished: free whatever KV is still parked for it (never awaits)."""


@dataclass
class Broken:
    """Why a gen stream ended before the request finished; ``migratable``: the server looks dead.
    ``moved``: the server drains with move_kv and parked the request's KV (the moved event's
    ``disaggregated_params``); ``server``: where the stream ran (set for a move)."""

    message: str
    migratable: bool = True
    moved: dict | None = None
    server: Server | None = None


MAX_MOVES = 16  # a request moved more often than this (drain after drain) fails instead


class GenRelay:
    """Runs the gen phase of one request to its end (see the module docstring).

    ``deadline_s``: a ``time.monotonic()`` instant after which an open stream is cut (one timer
    per stream). ``include_usage``: the client wants the usage chunk (made here if the last gen
    stream broke after its final token but before its usage chunk). ``moves``: follow a moved
    event to another gen server (else run() returns and ``broken`` holds it).
    """

    def __init__(self, progress: Progress, source: GenSource, migration_limit: int, metrics: Metrics,
                 endpoint: str, deadline_s: float, include_usage: bool, moves: bool = True) -> None:
        self.progress = progress
        self._source = source
        self._limit = migration_limit
        self._metrics = metrics
        self._endpoint = endpoint
        self._deadline_s = deadline_s
        self._include_usage = include_usage
        self._moves = moves  # False: a moved event ends run() (its caller continues the request: n > 1)
        self._itl = metrics.child(metrics.itl, endpoint)
        self.migrations = 0
        self.moves = 0
        self.finished = False
        self.broken: Broken | None = None  # why the last stream ended, when run() returned its failure
        self.chunks_sent = 0
        self.events = 0  # gen stream events read (every stream of the request; [DONE] not counted)
        self.passed = 0  # ... of which pass-through events relayed as the server wrote them
        self.t_last: float | None = None
        self._tail: list[bytes] = []  # client chunks that came in the piece holding [DONE] (take_tail)

    async def run(self, emit: Emit | None) -> str | None:
        """Relay until the request finishes (None) or fails for good (the failure's message).

        Raises:
            OrchestratorError: no gen stream could be opened (first or migration target).
        """
        try:
            return await self._run(emit)
        finally:
            if self.events:
                m = self._metrics
                m.child(m.relayed_events, "passed").inc(self.passed)
                m.child(m.relayed_events, "merged").inc(self.events - self.passed)

    async def _run(self, emit: Emit | None) -> str | None:
        gs = await self._source.first()
        while True:
            broken = await self._pump(gs, emit)
            if broken is None:
                self.finished = True
                return None
            if broken.moved is not None and broken.server is not None and self._moves and self.moves < MAX_MOVES:
                self.moves += 1
                self._metrics.moves.inc()
                log.info("%s; continuing on another gen server that pulls its KV (%d generated tokens, move %d)",
                         broken.message, len(self.progress.token_ids), self.moves)
                gs = await self._source.move(self.progress, broken.moved, broken.server)
                continue
            if not broken.migratable or self.migrations >= self._limit:
                self.broken = broken
                if broken.migratable and self._limit:
                    return f"{broken.message} (migration_limit {self._limit} reached)"
                return broken.message
            self.migrations += 1
            self._metrics.migrations.inc()
            log.warning("%s; migrating the request (%d generated tokens, migration %d of %d)", broken.message,
                        len(self.progress.token_ids), self.migrations, self._limit)
            gs = await self._source.migrate(self.progress)

    async def _pump(self, gs: GenStream, emit: Emit | None) -> Broken | None:
        timer = asyncio.get_running_loop().call_later(max(self._deadline_s - time.monotonic(), 0.0), gs.stream.expire)
        try:
            return await self._events(gs, emit)
        finally:
            timer.cancel()
            gs.stream.close()  # before [DONE] this is what aborts the gen request
            gs.server.in_flight -= 1

    async def _events(self, gs: GenStream, emit: Emit | None) -> Broken | None:
        """Merge the stream's events; the client's chunks of one upstream piece leave in one write
        (those of the piece that ends with ``[DONE]`` wait for the last write: :meth:`take_tail`).
        Without ``emit`` (an internal stream for a JSON answer) no chunk is encoded."""
        attempt, splitter, piece = self.progress.attempt(), EventSplitter(), gs.stream.first_chunk
        url = gs.server.url
        while True:
            out: list[bytes] | None = [] if emit is not None else None
            payloads = splitter.feed(piece)
            self.events += len(payloads)
            for payload in payloads:
                if payload == b"[DONE]":
                    self.events -= 1
                    self._tail = out or []
                    return None
                broken = self._event(payload, attempt, out, url)
                if broken is not None and broken.moved is not None:
                    await self._emit(emit, out)  # what came before the move is the client's
                    broken.server = gs.server  # a drain, not a failure: the server stays healthy
                    return broken
                if broken is not None:
                    await self._emit(emit, out)  # what came before the break is the client's
                    return self._broke(gs.server, broken)
            await self._emit(emit, out)
            try:
                piece = await gs.stream.next_chunk()
            except UpstreamError as err:
                return self._broke(gs.server, Broken(f"generation stream from {url} broke: {describe(err)}"))
            if piece is None:
                # A stream that already gave its final token has nothing left to migrate.
                done = self.progress.finish_reason is not None
                return self._broke(gs.server, Broken(f"generation stream from {url} ended without [DONE]", not done))

    def _event(self, payload: bytes, attempt: Attempt, out: list[bytes] | None, url: str) -> Broken | None:
        """Merge one event into the request (the client's chunk, if any, appended to ``out`` unless
        None); a :class:`Broken` when it is an error or not JSON."""
        if payload.startswith(RELAY_LINE):
            return self._passed(payload, attempt, out, url)
        try:
            event = jsonio.loads(payload)
        except ValueError:
            return Broken(f"generation stream from {url} sent an event that is not JSON")
        return self._merge(event, attempt, out, url)

    def _passed(self, payload: bytes, attempt: Attempt, out: list[bytes] | None, url: str) -> Broken | None:
        """Merge one pass-through event (``disaggregated_params.relay_head``): its record, then its
        chunk as the server wrote it when the chunk's text follows the client's (the usual case: no
        JSON is parsed or written); a chunk whose text overlaps what the client has (the first one
        after the ctx server's first token, or a migration's replay) is merged as any other event.
        Per event on the hot path: the checks are inlined (:meth:`Attempt.take_record` is the rule)."""
        nl = payload.find(b"\n")
        try:
            start, end, ids, finish = jsonio.loads(payload[len(RELAY_LINE):nl] if nl >= 0 else payload[len(RELAY_LINE):])
            if type(start) is not int or type(end) is not int or type(ids) is not list or (
                    finish is not None and type(finish) is not str):
                raise ValueError("not [start, end, [token ids], finish_reason]")
            if nl < 0 and end != start:
                raise ValueError("a record of text without its chunk")
            if attempt.take_record(start, end, ids, finish):
                self.passed += 1
                if nl >= 0 and out is not None:
                    out.append(payload[nl + 1:] + b"\n\n")
                return None
            if not payload.startswith(b"data: ", nl + 1):
                raise ValueError("the record is not followed by a data line")
            event = jsonio.loads(payload[nl + 7:])
            event["choices"][0][TOKEN_IDS_FIELD] = ids
        except (ValueError, TypeError, KeyError, IndexError) as err:
            return Broken(f"generation stream from {url} sent a bad pass-through event: {err}", migratable=False)
        return self._merge(event, attempt, out, url)

    def _merge(self, event: object, attempt: Attempt, out: list[bytes] | None, url: str) -> Broken | None:
        """:meth:`_event` for an event parsed from JSON."""
        if not isinstance(event, dict):
            return Broken(f"generation stream from {url} sent an event that is not a JSON object")
        if isinstance(event.get("moved"), dict):  # drain by moving KV: the request's KV is parked there
            return Broken(f"gen server {url} is draining and moved the request", migratable=False,
                          moved=event["moved"])
        if "error" in event:
            info = event["error"] if isinstance(event["error"], dict) else {}
            code = info.get("code")
            dead = info.get("type") in _DEATH_TYPES or (isinstance(code, int) and code >= 500)
            return Broken(f"generation stream from {url} failed: {info.get('message', event['error'])}", dead)
        try:
            chunk = attempt.absorb(event)
        except ValueError as err:
            return Broken(f"generation stream from {url} sent a bad chunk: {err}", migratable=False)
        if chunk is not None and out is not None:
            out.append(b"data: " + jsonio.dumps(chunk) + b"\n\n")
        return None

    async def _emit(self, emit: Emit | None, out: list[bytes] | None) -> None:
        """Write ``out`` (the client's chunks of one upstream piece) in one body message."""
        if out and emit is not None:
            await emit(out[0] if len(out) == 1 else b"".join(out))
            self._sent(len(out))

    def _sent(self, n: int) -> None:
        """Count ``n`` chunks written at once (ITL: the gap before the first, 0 between the rest)."""
        now = time.monotonic()
        if self.t_last is not None:
            self._itl.observe(now - self.t_last)
        if n > 1:
            self._itl.observe(0.0, n - 1)
        self.t_last = now
        self.chunks_sent += n

    def _broke(self, server: Server, broken: Broken) -> Broken:
        log.warning("%s", broken.message)
        if broken.migratable:
            server.mark_unhealthy(broken.message)
        self._metrics.errors.labels(kind="gen_stream").inc()
        return broken

    def take_tail(self) -> list[bytes]:
        """The client chunks that arrived with the final ``[DONE]`` (counted as sent now): the
        caller writes them with the stream's last body message."""
        tail, self._tail = self._tail, []
        if tail:
            self._sent(len(tail))
        return tail

    def usage_chunk(self) -> bytes | None:
        """The usage chunk to add at the end, when the client wants one and no gen stream sent it."""
        if not self._include_usage or self.progress.usage is not None or self.progress.head is None:
            return None
        obj = "chat.completion.chunk" if self.progress.chat else "text_completion"
        doc = {**self.progress.head, "object": obj, "choices": [], "usage": self.progress.final_usage()}
        return b"data: " + jsonio.dumps(doc) + b"\n\n"


class StreamAnswer:
    """The client's SSE response (an ASGI callable that never reads ``receive``): ``first`` (the
    ctx server's first token, or nothing on the colocated path) at once, then the relay.

    Whatever way it ends (finished, failed, cancelled because the client left), :meth:`close` runs
    once: it records E2E latency and, unless the request finished, abandons the source's lease.
    """

    status_code = 200

    def __init__(self, relay: GenRelay, source: GenSource, first: bytes | None, started_s: float,
                 metrics: Metrics, endpoint: str) -> None:
        self._relay, self._source, self._first = relay, source, first
        self._started_s, self._metrics, self._endpoint = started_s, metrics, endpoint
        self._closed = False
        self._t_first: float | None = None  # when the client's first body byte left

    def _first_byte(self) -> None:
        if self._t_first is None:
            self._t_first = time.monotonic()
            self._metrics.child(self._metrics.ttft, self._endpoint).observe(self._t_first - self._started_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def emit(data: bytes) -> None:
            self._first_byte()
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            await send({"type": "http.response.start", "status": 200, "headers": list(_SSE_HEADERS)})
            if self._first is not None:
                await emit(self._first)
            await self._relay_to(emit, send)
            self._observe_tpot()
        finally:
            self.close()

    async def _relay_to(self, emit: Emit, send: Send) -> None:
        try:
            failure = await self._relay.run(emit)
        except OrchestratorError as err:
            failure, type_, code = err.message, err.type_, err.status
        else:
            type_, code = "upstream_error", 502
        if failure is None:
            usage = self._relay.usage_chunk()
            pending = self._relay.take_tail()  # the last chunks: they leave with [DONE]
            if pending:
                self._first_byte()
            tail = pending + ([usage] if usage else []) + [SSE_DONE]
        else:
            tail = error_events(failure, type_, code)
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})

    def _observe_tpot(self) -> None:
        n = self._relay.chunks_sent + (self._first is not None)
        if self._t_first is not None and n > 1 and self._relay.t_last is not None:
            self._metrics.child(self._metrics.tpot, self._endpoint).observe((self._relay.t_last - self._t_first) / (n - 1))

    def close(self) -> None:
        """Idempotent cleanup; never awaits, so it also runs inside a cancelled task."""
        if self._closed:
            return
        self._closed = True
        self._metrics.child(self._metrics.e2e, self._endpoint).observe(time.monotonic() - self._started_s)
        if not self._relay.finished:
            self._source.abandon()
