"""Leases over parked KV blocks on a context server.

After prefill, a ``context_only`` request's blocks stay allocated ("parked") under a lease until
(a) the gen side confirms its pull (``release``), (b) the lease expires on a **timer** — a thread
that wakes at the earliest deadline, so an idle server frees blocks too — or (c) the orchestrator
cancels it. A lease being pulled is not expired mid-copy (that would ship freed, reusable blocks);
its expiry is applied when the pull ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class LeaseError(LookupError):
    """No lease for that id: never parked, already released, or expired."""


@dataclass
class Lease:
    """One parked request: its block ids (in token order) and deadline (``time.monotonic`` seconds)."""

    ctx_request_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    pulling: int = 0
    release_pending: bool = False


class LeaseTable:
    """Thread-safe table of leases with an expiry timer thread.

    ``on_free(ctx_request_id, reason)`` is called exactly once per lease, outside the table's lock,
    with reason ``"released"``, ``"expired"`` or ``"shutdown"``; it must free the engine's blocks.
    """

    def __init__(self, on_free: Callable[[str, str], None], pull_delay_s: float = 0.0) -> None:
        self._on_free = on_free
        self._pull_delay_s = pull_delay_s  # fault-injection tests only: widen the mid-pull window
        self._leases: dict[str, Lease] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._expire_loop, name="kv-lease-timer", daemon=True)
        self.expired_total = 0
        self.released_total = 0

    @property
    def pull_delay_s(self) -> float:
        """The fault-injection delay every :meth:`begin_pull` sleeps (0 outside tests)."""
        return self._pull_delay_s

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the timer and free every remaining lease (reason ``shutdown``)."""
        with self._cond:
            self._stopped = True
            leases = list(self._leases.values())
            self._leases.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for lease in leases:
            self._free(lease, "shutdown")

    def park(self, ctx_request_id: str, block_ids: list[int], num_tokens: int, ttl_s: float) -> Lease:
        """Register parked blocks; they are freed after ``ttl_s`` seconds unless released first."""
        lease = Lease(ctx_request_id, list(block_ids), num_tokens, time.monotonic() + ttl_s)
        with self._cond:
            if self._stopped:
                raise LeaseError("the lease table is stopped")
            self._leases[ctx_request_id] = lease
            self._cond.notify_all()
        return lease

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)

    def begin_pull(self, ctx_request_id: str) -> Lease:
        """Pin a lease while its blocks are copied out. Raises :class:`LeaseError` if it is gone."""
        with self._cond:
            lease = self._leases.get(ctx_request_id)
            if lease is None or lease.release_pending:
                raise LeaseError(f"no KV lease for {ctx_request_id!r}: never parked, already released or expired")
            lease.pulling += 1
        if self._pull_delay_s:
            time.sleep(self._pull_delay_s)
        return lease

    def end_pull(self, ctx_request_id: str) -> None:
        """Unpin after a pull (success or not); applies a release or expiry that came meanwhile."""
        with self._cond:
            lease = self._leases.get(ctx_request_id)
            if lease is None:
                return
            lease.pulling -= 1
            done = lease.pulling == 0 and (lease.release_pending or lease.deadline <= time.monotonic())
            reason = "released" if lease.release_pending else "expired"
            if done:
                del self._leases[ctx_request_id]
        if done:
            self._free(lease, reason)

    def release(self, ctx_request_id: str) -> bool:
        """Free a lease now (or right after its in-progress pull). False if it was not there."""
        with self._cond:
            lease = self._leases.get(ctx_request_id)
            if lease is None or lease.release_pending:
                return False  # gone, or already released (freed when its pull ends)
            if lease.pulling:
                lease.release_pending = True
                return True
            del self._leases[ctx_request_id]
        self._free(lease, "released")
        return True

    def _free(self, lease: Lease, reason: str) -> None:
        if reason == "expired":
            self.expired_total += 1
            log.warning("KV lease %s expired unpulled; freeing %d blocks", lease.ctx_request_id, len(lease.block_ids))
        elif reason == "released":
            self.released_total += 1
        self._on_free(lease.ctx_request_id, reason)

    def _expire_loop(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                expired = [l for l in self._leases.values() if l.deadline <= now and not l.pulling]
                for lease in expired:
                    del self._leases[lease.ctx_request_id]
                if not expired:
                    pending = [l.deadline for l in self._leases.values() if not l.pulling]
                    # Wake at the earliest deadline; re-check at least once a second (pinned leases).
                    wait_s = min([d - now for d in pending] + [1.0])
                    self._cond.wait(max(wait_s, 0.001))
                    continue
            for lease in expired:
                self._free(lease, "expired")
