"""KV events: what a server's prefix cache stored and removed, in an ordered, gap-detectable stream.

Shared by the servers (producers, :mod:`engine.kv_event_log` and :mod:`executor.kv_event_routes`) and
the orchestrator (consumer, :mod:`orchestrator.kv_feed`). Torch-free and pydantic-free: plain
dataclasses and one JSON line per message.

Vocabulary (vLLM's KV event kinds): :class:`BlockStored` (full blocks entered the prefix cache,
named by their chained hashes, ``parent`` the hash of the block before the first one, ``None`` at
the root), :class:`BlockRemoved` (blocks were evicted: their hashes are forgotten),
:class:`AllBlocksCleared` (``POST /reset_prefix_cache``: every hash is forgotten).

Order and gaps: the events of one engine step form one :class:`KVEventBatch` with ``seq`` one
above the previous batch's (per server, from 1) and the server's ``epoch`` (a random id made when its
engine starts: a restarted server has a new one and counts from 1 again). A consumer that sees a
``seq`` other than its last + 1, or another ``epoch``, has missed events: it drops what it knows and
resynchronizes from a :class:`KVSnapshot` (every hash held at ``seq``), then applies the batches
above ``seq``.

Wire (``GET /kv_events`` of every server, NDJSON): one JSON object per line, ``{"type": "snapshot",
"epoch", "seq", "hashes": [hex, ...]}`` first, then ``{"type": "batch", "epoch", "seq", "events":
[{"kind": "stored", "hashes": [...], "parent": hex|null} | {"kind": "removed", "hashes": [...]} |
{"kind": "cleared"}]}`` lines, ``{"type": "heartbeat", "epoch", "seq"}`` while idle, and
``{"type": "gap", ...}`` just before the server ends a stream that fell behind its buffer.
Hashes are the 16-byte :mod:`pdserve.block_hash` names, as lowercase hex.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class BlockStored:
    """Full blocks that entered the prefix cache, in chain order; ``parent``: the hash before the first."""

    hashes: tuple[bytes, ...]
    parent: bytes | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks whose hashes the server forgot (evicted for other tokens)."""

    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash was forgotten (``POST /reset_prefix_cache``)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step: ``seq`` (1, 2, ... per ``epoch``) orders the batches."""

    epoch: str
    seq: int
    events: tuple[KVEvent, ...]

    @property
    def num_events(self) -> int:
        return len(self.events)


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a server's prefix cache held when batch ``seq`` (0: none yet) was the last."""

    epoch: str
    seq: int
    hashes: tuple[bytes, ...]


class KVWireError(ValueError):
    """A KV event line that is not valid JSON of the documented shape."""


# ---- encoding ---------------------------------------------------------------------------------------
def _event_json(ev: KVEvent) -> dict:
    if isinstance(ev, BlockStored):
        return {"kind": "stored", "hashes": [h.hex() for h in ev.hashes],
                "parent": ev.parent.hex() if ev.parent is not None else None}
    if isinstance(ev, BlockRemoved):
        return {"kind": "removed", "hashes": [h.hex() for h in ev.hashes]}
    return {"kind": "cleared"}


def batch_line(batch: KVEventBatch) -> bytes:
    """One NDJSON line (with its ``\\n``) for ``batch``."""
    return _line({"type": "batch", "epoch": batch.epoch, "seq": batch.seq,
                  "events": [_event_json(e) for e in batch.events]})


def snapshot_line(snap: KVSnapshot) -> bytes:
    """One NDJSON line for ``snap``."""
    return _line({"type": "snapshot", "epoch": snap.epoch, "seq": snap.seq, "hashes": [h.hex() for h in snap.hashes]})


def control_line(kind: str, epoch: str, seq: int, reason: str | None = None) -> bytes:
    """A ``heartbeat`` or ``gap`` line: ``seq`` is the last batch the stream sent."""
    body: dict = {"type": kind, "epoch": epoch, "seq": seq}
    if reason is not None:
        body["reason"] = reason
    return _line(body)


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


# ---- decoding ---------------------------------------------------------------------------------------
def _hashes(value: object) -> tuple[bytes, ...]:
    if not isinstance(value, list):
        raise KVWireError("hashes must be a list")
    try:
        return tuple(bytes.fromhex(h) for h in value)
    except (TypeError, ValueError):
        raise KVWireError("a hash is not a hex string") from None


def _event(obj: object) -> KVEvent:
    if not isinstance(obj, dict):
        raise KVWireError("an event must be an object")
    kind = obj.get("kind")
    if kind == "stored":
        parent = obj.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise KVWireError("parent must be a hex string or null")
        return BlockStored(_hashes(obj.get("hashes")), _hashes([parent])[0] if parent else None)
    if kind == "removed":
        return BlockRemoved(_hashes(obj.get("hashes")))
    if kind == "cleared":
        return AllBlocksCleared()
    raise KVWireError(f"unknown event kind {kind!r}")


def parse_line(line: str | bytes) -> KVSnapshot | KVEventBatch | tuple[str, str, int]:
    """Decode one NDJSON line: a snapshot, a batch, or ``(type, epoch, seq)`` for heartbeat/gap.

    Raises:
        KVWireError: not JSON, or not one of the documented shapes.
    """
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the decoder's stack
        raise KVWireError("not JSON") from None
    if not isinstance(obj, dict):
        raise KVWireError("a line must be an object")
    kind, epoch, seq = obj.get("type"), obj.get("epoch"), obj.get("seq")
    if not isinstance(epoch, str) or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise KVWireError("epoch must be a string and seq an integer >= 0")
    if kind == "snapshot":
        return KVSnapshot(epoch, seq, _hashes(obj.get("hashes")))
    if kind == "batch":
        events = obj.get("events")
        if not isinstance(events, list):
            raise KVWireError("events must be a list")
        return KVEventBatch(epoch, seq, tuple(_event(e) for e in events))
    if kind in ("heartbeat", "gap"):
        return (kind, epoch, seq)
    raise KVWireError(f"unknown line type {kind!r}")
