"""The orchestrator's view of which prefix blocks each server actually holds (from its KV events).

One :class:`ServerKVIndex` per member: the set of block hashes the member's prefix cache holds,
rebuilt from a :class:`pdserve.kv_events.KVSnapshot` and kept current by applying each
:class:`pdserve.kv_events.KVEventBatch` in ``seq`` order. An index is *synced* only between a
snapshot and the first irregularity: a batch of another epoch (the server restarted), a batch whose
``seq`` is not the last + 1 (events were lost), a broken stream, or the member leaving. Then it is
dropped at once (:meth:`ServerKVIndex.drop`): the router never scores a server on a stale index;
that server gets load-only scoring until a fresh snapshot syncs it again.

Bounded: an index holds at most ``max_blocks`` hashes (a server's cache cannot hold more blocks
than it has; the bound guards against a misbehaving peer). Past it the index is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot

log = logging.getLogger("orchestrator.kv_index")

MAX_INDEX_BLOCKS = 1 << 20  # per server: 16-byte hashes, ~100 MB of Python objects at most


class KVStreamGap(Exception):
    """A batch that does not follow the index (other epoch, or a missing ``seq``): resync needed."""


class ServerKVIndex:
    """Held block hashes of one server; ``synced`` says whether they may be routed on."""

    def __init__(self, url: str, max_blocks: int = MAX_INDEX_BLOCKS) -> None:
        self.url = url
        self.max_blocks = max_blocks
        self.epoch: str | None = None
        self.seq = 0
        self.hashes: set[bytes] = set()
        self.synced = False
        self.reason = "no snapshot yet"  # why it is not synced
        self.resyncs = 0                 # snapshots loaded (the first one included)

    def load_snapshot(self, snap: KVSnapshot) -> None:
        """Replace everything with ``snap``; the index is synced at ``snap.seq``.
        Raises KVStreamGap when the snapshot is over ``max_blocks``."""
        if len(snap.hashes) > self.max_blocks:
            self.drop(f"snapshot of {len(snap.hashes)} blocks is over the index bound {self.max_blocks}")
            raise KVStreamGap(self.reason)
        if self.epoch is not None and snap.epoch != self.epoch:
            log.info("%s restarted (KV event epoch %s -> %s): index rebuilt", self.url, self.epoch, snap.epoch)
        self.epoch, self.seq, self.hashes = snap.epoch, snap.seq, set(snap.hashes)
        self.synced, self.reason = True, ""
        self.resyncs += 1

    def apply(self, batch: KVEventBatch) -> None:
        """Apply the next batch. A batch at or below ``seq`` of the same epoch is skipped (the
        snapshot already covers it).

        Raises:
            KVStreamGap: not synced, another epoch, a missing ``seq``, or over ``max_blocks``
                (the index is dropped first).
        """
        if not self.synced:
            raise KVStreamGap(f"batch {batch.seq} before a snapshot")
        if batch.epoch != self.epoch:
            self.drop(f"epoch changed {self.epoch} -> {batch.epoch} (server restarted)")
            raise KVStreamGap(self.reason)
        if batch.seq <= self.seq:
            return
        if batch.seq != self.seq + 1:
            self.drop(f"sequence gap: batch {batch.seq} after {self.seq}")
            raise KVStreamGap(self.reason)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.hashes.update(ev.hashes)
            elif isinstance(ev, BlockRemoved):
                self.hashes.difference_update(ev.hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.hashes.clear()
        self.seq = batch.seq
        if len(self.hashes) > self.max_blocks:
            self.drop(f"index over its bound of {self.max_blocks} blocks")
            raise KVStreamGap(self.reason)

    def drop(self, reason: str) -> None:
        """Forget every hash: load-only scoring until the next snapshot."""
        if self.synced:
            log.info("%s KV index dropped: %s", self.url, reason)
        self.hashes = set()
        self.synced, self.reason = False, reason

    def matched_blocks(self, block_hashes: Sequence[bytes]) -> int | None:
        """Length (blocks) of the longest prefix of ``block_hashes`` held; None when not synced."""
        if not self.synced:
            return None
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def status(self) -> dict:
        return {"synced": self.synced, "epoch": self.epoch, "seq": self.seq, "blocks": len(self.hashes),
                "resyncs": self.resyncs, "reason": self.reason or None}


class KVIndexes:
    """Every member's :class:`ServerKVIndex`, by URL (created on first use)."""

    def __init__(self, max_blocks: int = MAX_INDEX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._by_url: dict[str, ServerKVIndex] = {}

    def get(self, url: str) -> ServerKVIndex:
        index = self._by_url.get(url)
        if index is None:
            index = self._by_url[url] = ServerKVIndex(url, self.max_blocks)
        return index

    def find(self, url: str) -> ServerKVIndex | None:
        return self._by_url.get(url)

    def forget(self, url: str) -> None:
        """The member left: its index goes."""
        self._by_url.pop(url, None)

    def urls(self) -> list[str]:
        return list(self._by_url)

    def matched_blocks(self, url: str, block_hashes: Sequence[bytes]) -> int | None:
        """Prefix blocks of ``block_hashes`` that ``url`` holds; None: no synced index for it."""
        index = self._by_url.get(url)
        return None if index is None else index.matched_blocks(block_hashes)
