"""Leases pinned past the end of their pull, until the gen side confirms or a deadline passes.

Part of the UCX protocol (:mod:`kv_transfer.ucx_backend`): once a ctx server has answered a pull,
the gen side may be reading the blocks; the pin ends with the gen side's ``done`` (or completed
sends), else when the hold's deadline passes, after which the lease may expire or be freed.
"""

from __future__ import annotations

import logging
import threading
import time

from kv_transfer.lease import LeaseTable

log = logging.getLogger(__name__)


class PinHolds:
    """Leases pinned past the end of their pull: until the gen side says ``done`` or the hold
    deadline passes (then unpinned by :meth:`reap`). Keys are ``(ctx_request_id, tag base, reply_to)``:
    one pull of one gen client."""

    def __init__(self, leases: LeaseTable) -> None:
        self._leases = leases
        self._holds: dict[tuple[str, int, str], tuple[float, float, int]] = {}  # → (until, t0, bytes)
        self._lock = threading.Lock()

    def hold(self, key: tuple[str, int, str], until: float, nbytes: int = 0) -> bool:
        """Register a pin's hold; False if one with this key exists (a duplicated pull message)."""
        with self._lock:
            if key in self._holds:
                return False
            self._holds[key] = (until, time.perf_counter(), nbytes)
            return True

    def done(self, key: tuple[str, int, str], release: bool) -> tuple[float, int] | None:
        """Unpin (and release) a held lease; its (seconds held, bytes), or None if it was not held."""
        with self._lock:
            held = self._holds.pop(key, None)
        if held is None:
            return None
        rid = key[0]
        if release:
            self._leases.release(rid)  # still pinned: applied by end_pull
        self._leases.end_pull(rid)
        return time.perf_counter() - held[1], held[2]

    def reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [key for key, (until, _, _) in self._holds.items() if until <= now]
            for key in expired:
                del self._holds[key]
        for rid, _, _ in expired:
            log.warning("KV pull of %s was never confirmed by the gen side; unpinning its lease", rid)
            self._leases.end_pull(rid)

    def clear(self) -> None:
        with self._lock:
            keys = list(self._holds)
            self._holds.clear()
        for rid, _, _ in keys:
            self._leases.end_pull(rid)
