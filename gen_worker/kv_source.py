"""Where each ``generation_only`` request's KV comes from, and when its pull may start.

The gen role's one answer to "may this request's KV move yet": a ``context_first`` request names
its ctx source when it is submitted, so its pull starts as soon as the engine has allocated its
blocks. A ``generation_first`` request (``DisaggregatedParams.awaits_ctx``) is admitted before
the ctx server has parked anything: the engine may allocate first (its pull is held here) or the
source may come first (kept here until the engine allocates). Whichever comes second releases
the pull. Engine loop thread only (no lock).
"""

from __future__ import annotations

from engine.request import KVPull
from pdserve.protocol import DisaggregatedParams

Ready = tuple[KVPull, DisaggregatedParams]


class KVSources:
    """Per request id: its known ctx source, or the fact that one is awaited, and a held pull."""

    def __init__(self) -> None:
        self._known: dict[str, DisaggregatedParams] = {}
        self._awaited: set[str] = set()
        self._held: dict[str, KVPull] = {}

    def submitted(self, request_id: str, params: DisaggregatedParams) -> None:
        """A ``generation_only`` request arrived with ``params`` (its source, or ``awaits_ctx``)."""
        if params.awaits_ctx:
            self._awaited.add(request_id)
        else:
            self._known[request_id] = params

    def allocated(self, pull: KVPull) -> Ready | None:
        """The engine allocated ``pull``'s blocks: (pull, source) when it may start now, None if it is
        held for its source. Raises KeyError for a request this role never saw."""
        rid = pull.request_id
        if rid in self._known:
            return pull, self._known.pop(rid)
        if rid in self._awaited:
            self._held[rid] = pull
            return None
        raise KeyError(rid)

    def source_ready(self, request_id: str, params: DisaggregatedParams) -> Ready | None:
        """The ctx server parked ``request_id``'s KV: (pull, source) when its blocks are allocated
        already, else None (kept until :meth:`allocated`). Ignored for a request not awaited (aborted)."""
        if request_id not in self._awaited:
            return None
        self._awaited.discard(request_id)
        pull = self._held.pop(request_id, None)
        if pull is None:
            self._known[request_id] = params
            return None
        return pull, params

    def forget(self, request_id: str) -> None:
        """The request ended (aborted, failed) before its pull started."""
        self._known.pop(request_id, None)
        self._awaited.discard(request_id)
        self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._known) + len(self._awaited)
