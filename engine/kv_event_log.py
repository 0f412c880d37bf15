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
        self._pending: list[KVEvent] = []

    def stored(self, block_hash: bytes, parent: bytes | None) -> None:
        """One full block entered the cache (``parent``: the hash of the block before it)."""
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and last.hashes[-1] == parent:
            self._pending[-1] = BlockStored(last.hashes + (block_hash,), last.parent)
        else:
            self._pending.append(BlockStored((block_hash,), parent))

    def removed(self, block_hash: bytes) -> None:
        """One cached block's hash was forgotten (evicted)."""
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            self._pending[-1] = BlockRemoved(last.hashes + (block_hash,))
        else:
            self._pending.append(BlockRemoved((block_hash,)))

    def cleared(self) -> None:
        """Every hash was forgotten: earlier records of this step no longer matter."""
        self._pending = [AllBlocksCleared()]

    def take(self) -> KVEventBatch | None:
        """The records since the last call as the next batch (``seq`` + 1), or None when there are none."""
        if not self._pending:
            return None
        self.seq += 1
        batch, self._pending = KVEventBatch(self.epoch, self.seq, tuple(self._pending)), []
        return batch

    def snapshot(self, held: list[bytes]) -> KVSnapshot:
        """``held`` (every cached hash now) as valid at :attr:`seq`. Call :meth:`take` first, or the
        pending records' effects would be in the snapshot but not below its ``seq``."""
        if self._pending:
            raise RuntimeError("take the pending KV events before a snapshot")
        return KVSnapshot(self.epoch, self.seq, tuple(held))
