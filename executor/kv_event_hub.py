"""A frontend's buffer of recent KV event batches, read by its ``GET /kv_events`` streams.

Rank 0's engine loop pushes each step's :class:`pdserve.kv_events.KVEventBatch` to every frontend
(:class:`executor.messages.KVEvents`); the lane's receiver thread hands it to :meth:`KVEventHub.publish`.
The hub keeps the newest batches up to ``max_events`` events in all (older batches fall off), so a
slow or absent consumer costs a bounded amount of memory and never blocks the engine: a reader that
fell behind the oldest buffered batch gets a gap (:meth:`KVEventHub.read_after` raises
:class:`FellBehind`) and resynchronizes from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from pdserve.kv_events import KVEventBatch

MAX_BUFFERED_EVENTS = 65536  # per frontend; one event names one or more blocks of one step


class FellBehind(Exception):
    """The batches after the reader's position are no longer buffered (or belong to another epoch)."""


class KVEventHub:
    """Thread-safe ring of batches (publish from any thread) with an asyncio wake-up for readers."""

    def __init__(self, max_events: int = MAX_BUFFERED_EVENTS) -> None:
        self.max_events = max_events
        self._lock = threading.Lock()
        self._ring: deque[KVEventBatch] = deque()
        self._events = 0
        self.dropped_batches = 0  # fell off the ring (counted, for /metrics)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.closed = False  # the server is stopping: streams end (they must not hold up its exit)

    def publish(self, batch: KVEventBatch) -> None:
        """Append ``batch`` (any thread); the oldest batches fall off past ``max_events``."""
        with self._lock:
            if self._ring and self._ring[-1].epoch != batch.epoch:
                self._ring.clear()
                self._events = 0
            self._ring.append(batch)
            self._events += batch.num_events
            while self._events > self.max_events and len(self._ring) > 1:
                self._events -= self._ring.popleft().num_events
                self.dropped_batches += 1
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        """End every reader's wait now and make the streams finish (any thread)."""
        with self._lock:
            self.closed = True
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def read_after(self, epoch: str, seq: int) -> list[KVEventBatch]:
        """The buffered batches of ``epoch`` numbered above ``seq``, in order (maybe none).

        Raises:
            FellBehind: batch ``seq + 1`` fell off the ring, or the ring holds another epoch.
        """
        with self._lock:
            ring = list(self._ring)
        if not ring:
            return []
        if ring[-1].epoch != epoch:
            raise FellBehind(f"the server's KV event epoch is {ring[-1].epoch}, not {epoch}")
        newer = [b for b in ring if b.seq > seq]
        if newer and newer[0].seq != seq + 1:
            raise FellBehind(f"KV event batches {seq + 1}..{newer[0].seq - 1} are no longer buffered")
        return newer

    async def wait(self, epoch: str, seq: int, timeout_s: float) -> bool:
        """Wait until the ring holds a batch newer than (``epoch``, ``seq``) or the hub closes
        (True), or ``timeout_s`` seconds pass (False), whichever comes first."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(entry)  # registered before the check: a publish in between still wakes us
            newer = self.closed or (bool(self._ring) and (self._ring[-1].epoch != epoch or self._ring[-1].seq > seq))
        if newer:
            with self._lock:
                self._waiters.discard(entry)
            return True
        try:
            await asyncio.wait_for(entry[1].wait(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                self._waiters.discard(entry)

    def stats(self) -> dict[str, int]:
        """``kv_events_buffered_batches`` and ``kv_events_dropped_batches``."""
        with self._lock:
            return {"kv_events_buffered_batches": len(self._ring), "kv_events_dropped_batches": self.dropped_batches}
