"""The engine side of KV events: what the block manager stored and removed since the last step.

The block manager records into a :class:`KVEventLog` (a list append per cached or evicted block:
the hot path pays no more); the engine loop calls :meth:`KVEventLog.take` once per iteration, which
numbers what accumulated as one :class:`pdserve.kv_events.KVEventBatch`. Consecutive stored (or
removed) records fuse into one event. The log holds at most one step's records: the loop takes
them every iteration, so it never grows past what one step touches (each record is one block).
"""

from __future__ import annotations

import uuid

from pdserve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, KVSnapshot


class KVEventLog:
    """Per-server event numbering. ``epoch``: random per engine (a restarted server gets a new one)."""

    def __init__(self, epoch: str | None = None) -> None:
        self.epoch = epoch or uuid.uuid4().hex[:16]
        self.seq = 0  # the last batch taken
        # Records as mutable runs ["stored" | "removed" | "cleared", hashes, parent], frozen into
        # events at take(): appending to a run is O(1) (a tuple concatenation per block was O(n)).
        self._pending: list[list] = []

    def stored(self, block_hash: bytes, parent: bytes | None) -> None:
        """One full block entered the cache (``parent``: the hash of the block before it)."""
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "stored" and last[1][-1] == parent:
            last[1].append(block_hash)
        else:
            self._pending.append(["stored", [block_hash], parent])

    def removed(self, block_hash: bytes) -> None:
        """One cached block's hash was forgotten (evicted)."""
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "removed":
            last[1].append(block_hash)
        else:
            self._pending.append(["removed", [block_hash], None])

    def cleared(self) -> None:
        """Every hash was forgotten: earlier records of this step no longer matter."""
        self._pending = [["cleared", [], None]]

    def take(self) -> KVEventBatch | None:
        """The records since the last call as the next batch (``seq`` + 1), or None when there are none."""
        if not self._pending:
            return None
        self.seq += 1
        events = tuple(_freeze(kind, hashes, parent) for kind, hashes, parent in self._pending)
        self._pending = []
        return KVEventBatch(self.epoch, self.seq, events)

    def snapshot(self, held: list[bytes]) -> KVSnapshot:
        """``held`` (every cached hash now) as valid at :attr:`seq`. Call :meth:`take` first, or the
        pending records' effects would be in the snapshot but not below its ``seq``."""
        if self._pending:
            raise RuntimeError("take the pending KV events before a snapshot")
        return KVSnapshot(self.epoch, self.seq, tuple(held))


def _freeze(kind: str, hashes: list[bytes], parent: bytes | None) -> KVEvent:
    if kind == "stored":
        return BlockStored(tuple(hashes), parent)
    if kind == "removed":
        return BlockRemoved(tuple(hashes))
    return AllBlocksCleared()
