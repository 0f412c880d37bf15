"""generation_first on the ctx side: who waits for which ``disagg_request_id``, and what became of it.

A gen server's wait (``POST /disagg/lease``, wire format in :mod:`pdserve.kv_wait`) and the
orchestrator's context request leave the orchestrator at the same time and may reach this server
in either order. :class:`LeaseWaits` meets them: a wait that comes first is held until
:meth:`LeaseWaits.settle` (the request parked, finished at its first token, or failed); an outcome
that comes first is kept (``keep_s``, or until its lease is freed: :meth:`LeaseWaits.forget`) and
answers a later wait at once. It also maps a ``disagg_request_id`` to the engine request id of its
context phase, so an abandoned wait can free that request's blocks.

Used on the engine loop thread only (the ctx worker role's hooks), so it takes no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from pdserve.kv_wait import MAX_WAIT_MS, LeaseWaitAnswer

Reply = Callable[[LeaseWaitAnswer], None]
WAITER_GRACE_S = 5.0  # a waiter whose frontend never cancelled it is dropped this long after MAX_WAIT_MS


class LeaseWaits:
    """Waits and outcomes keyed by ``disagg_request_id`` (engine loop thread only).

    Args:
        keep_s: how long an outcome nobody asked for yet is kept (the lease time: a parked lease
            is gone after it anyway), seconds.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, keep_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s, self._clock = keep_s, clock
        self._waiters: dict[str, dict[int, tuple[float, Reply]]] = {}   # disagg id -> call id -> (drop at, reply)
        self._outcomes: OrderedDict[str, tuple[float, LeaseWaitAnswer]] = OrderedDict()  # in expiry order
        self._request_of: dict[str, str] = {}  # disagg id -> engine request id of its context phase
        self._disagg_of: dict[str, str] = {}   # the reverse
        self.answered = 0                      # waits answered with an outcome (a counter)

    # ---- the context phase ----------------------------------------------------------------
    def bind(self, disagg_request_id: str, request_id: str) -> None:
        """The context phase of ``disagg_request_id`` runs as engine request ``request_id``."""
        self._request_of[disagg_request_id] = request_id
        self._disagg_of[request_id] = disagg_request_id

    def request_of(self, disagg_request_id: str) -> str | None:
        return self._request_of.get(disagg_request_id)

    def disagg_of(self, request_id: str) -> str | None:
        return self._disagg_of.get(request_id)

    def unbind(self, request_id: str) -> None:
        """The engine request's blocks are gone (finished, or its lease freed): forget it."""
        disagg = self._disagg_of.pop(request_id, None)
        if disagg is not None and self._request_of.get(disagg) == request_id:
            del self._request_of[disagg]

    def settle(self, disagg_request_id: str, answer: LeaseWaitAnswer) -> None:
        """Answer every wait for ``disagg_request_id`` and keep ``answer`` for later ones."""
        self._prune()
        for _, reply in self._waiters.pop(disagg_request_id, {}).values():
            self.answered += 1
            reply(answer)
        self._outcomes.pop(disagg_request_id, None)
        self._outcomes[disagg_request_id] = (self._clock() + self.keep_s, answer)

    def outcome(self, disagg_request_id: str) -> LeaseWaitAnswer | None:
        entry = self._outcomes.get(disagg_request_id)
        return None if entry is None else entry[1]

    def forget(self, disagg_request_id: str) -> None:
        """The outcome is stale (its lease was freed): a later wait waits again (and times out)."""
        self._outcomes.pop(disagg_request_id, None)

    # ---- the waits ------------------------------------------------------------------------
    def wait(self, disagg_request_id: str, call_id: int, reply: Reply) -> None:
        """``reply(answer)`` now if the outcome is known, else when :meth:`settle` brings it."""
        self._prune()
        known = self.outcome(disagg_request_id)
        if known is not None:
            self.answered += 1
            reply(known)
            return
        drop_at = self._clock() + MAX_WAIT_MS / 1000.0 + WAITER_GRACE_S
        self._waiters.setdefault(disagg_request_id, {})[call_id] = (drop_at, reply)

    def cancel(self, disagg_request_id: str, call_id: int) -> None:
        waiters = self._waiters.get(disagg_request_id)
        if waiters is not None:
            waiters.pop(call_id, None)
            if not waiters:
                del self._waiters[disagg_request_id]

    def num_waiting(self) -> int:
        """Waits held now (any thread may ask: reads a copy)."""
        return sum(len(w) for w in list(self._waiters.values()))

    def _prune(self) -> None:
        now = self._clock()
        while self._outcomes:
            key, (expires, _) = next(iter(self._outcomes.items()))
            if expires > now:
                break
            del self._outcomes[key]
        for disagg in [d for d, w in self._waiters.items() if all(t <= now for t, _ in w.values())]:
            del self._waiters[disagg]  # frontends that never cancelled (a frontend died mid-wait)
