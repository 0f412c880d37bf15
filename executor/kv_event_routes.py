"""``GET /kv_events`` and ``GET /kv_events/snapshot`` of every ctx/gen server frontend.

The stream (NDJSON, :mod:`pdserve.kv_events`) opens with a snapshot of every cached block hash
taken by rank 0's engine loop (the frontend waits for it, bounded by the control-call timeout: a
long prefill step delays it), then sends each KV event batch above the snapshot's ``seq`` as this
frontend's :class:`executor.kv_event_hub.KVEventHub` receives it, and a heartbeat line after every
``heartbeat_s`` seconds without a batch (so a consumer's read timeout tells a dead stream from an
idle cache). A reader that falls behind the hub's buffer gets a ``gap`` line and the stream ends:
it reconnects and starts again from a fresh snapshot. The stream also ends when the engine dies
or the server stops (:meth:`KVEventHub.close`).

Why HTTP streaming (and not, say, a ZMQ PUB socket): see docs/architecture.md, "KV events".
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse

from executor.engine_client import EngineClient, EngineDeadError, EngineState
from executor.kv_event_hub import FellBehind, KVEventHub
from pdserve.kv_events import KVSnapshot, batch_line, control_line, snapshot_line
from pdserve.protocol import error_body

HEARTBEAT_S = 1.0
NDJSON = "application/x-ndjson"


async def event_lines(client: EngineClient, hub: KVEventHub, snap: KVSnapshot,
                      heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[bytes]:
    """The stream after ``snap``: its line, then batches / heartbeats until a gap, death or close."""
    yield snapshot_line(snap)
    epoch, seq = snap.epoch, snap.seq
    while not hub.closed and client.state != EngineState.DEAD:
        try:
            batches = hub.read_after(epoch, seq)
        except FellBehind as err:
            yield control_line("gap", epoch, seq, str(err))
            return
        for batch in batches:
            yield batch_line(batch)
            seq = batch.seq
        if not batches:
            if not await hub.wait(epoch, seq, heartbeat_s):
                yield control_line("heartbeat", epoch, seq)


def kv_event_router(client: EngineClient, heartbeat_s: float = HEARTBEAT_S) -> APIRouter:
    """The two routes over ``client`` (its ``kv_events`` hub and ``kv_snapshot`` call)."""
    router = APIRouter()

    async def snapshot_or_503() -> KVSnapshot | Response:
        try:
            return await client.kv_snapshot()
        except (EngineDeadError, TimeoutError) as err:
            return JSONResponse(error_body(f"no KV snapshot: {err or 'the engine did not answer in time'}",
                                           "service_unavailable", 503), status_code=503)

    @router.get("/kv_events")
    async def kv_events() -> Response:
        snap = await snapshot_or_503()
        if isinstance(snap, Response):
            return snap
        return StreamingResponse(event_lines(client, client.kv_events, snap, heartbeat_s), media_type=NDJSON,
                                 headers={"cache-control": "no-store"})

    @router.get("/kv_events/snapshot")
    async def kv_events_snapshot() -> Response:
        snap = await snapshot_or_503()
        if isinstance(snap, Response):
            return snap
        return Response(snapshot_line(snap), media_type="application/json")

    return router
