"""The interface between a server's HTTP layer and its engine: submit, abort, stream of responses.

The HTTP code (``executor.http_server``) and the phase handlers (``ctx_worker``, ``gen_worker``)
talk to an engine only through :class:`EngineClient`. Two implementations share its frontend half
(``executor.worker_client``) and the engine loop (``executor.engine_loop``): the in-process executor
(``executor.inproc_executor``, the loop in a thread of the server process) and the lattice
(``executor.lattice_client``: MPI ranks behind IPC lanes), so the HTTP code does not change.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine (and torch) are only needed by implementations
    from engine.request import EngineRequest, RequestOutput
    from engine.tokenizer import Tokenizer
    from executor.kv_event_hub import KVEventHub
    from pdserve.kv_events import KVSnapshot
    from pdserve.protocol import DisaggregatedParams


class EngineState(str, enum.Enum):
    """Admission gate of an engine: only ``SERVING`` admits new requests."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"


class EngineDeadError(RuntimeError):
    """The engine failed and is dead for good (sticky): every pending and new request gets this."""


class EngineNotServingError(RuntimeError):
    """The engine does not admit new requests now (starting or draining); try another server."""


class EngineClient(abc.ABC):
    """Submit requests to one engine and stream its outputs back (asyncio side).

    Implementations must be usable from one asyncio event loop; they own the engine loop and stop
    it in :meth:`shutdown`.
    """

    kv_events: "KVEventHub | None" = None  # the prefix cache's recent KV event batches (None: not published)

    async def kv_snapshot(self) -> "KVSnapshot":
        """Every block hash the prefix cache holds, valid at its ``seq`` (:mod:`pdserve.kv_events`).

        Raises:
            EngineDeadError: the engine is dead.
            TimeoutError: the engine did not answer within a bounded wait.
            NotImplementedError: this client publishes no KV events.
        """
        raise NotImplementedError("this engine client publishes no KV events")

    @property
    @abc.abstractmethod
    def state(self) -> EngineState:
        """Current admission state."""

    @property
    @abc.abstractmethod
    def dead_reason(self) -> str | None:
        """Why the engine died (``None`` while alive)."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> "Tokenizer":
        """The model's tokenizer (encode, decode, chat template)."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context window in tokens (prompt + output)."""

    @abc.abstractmethod
    def generate(self, request: "EngineRequest",
                 disagg: "DisaggregatedParams | None" = None) -> AsyncIterator[object]:
        """Submit ``request`` and yield its outputs until a :class:`RequestOutput` has ``finished``.

        ``disagg`` carries the phase routing to the worker side (the ctx role parks the blocks of
        a ``context_only`` request; the gen role pulls the KV of a ``generation_only`` one). Besides
        engine outputs the stream may yield :class:`executor.kv_role.KVHandoff` and
        :class:`executor.kv_role.KVTransferDone`. Closing the iterator early aborts the request.

        Raises:
            EngineDeadError: the engine is dead (at submit or while the request is pending).
            EngineNotServingError: the engine is starting or draining.
            engine.errors.RequestValidationError: the engine refused the request (e.g. too long).
            executor.phases.PhaseError: the worker side failed the request (e.g. a KV pull).
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its blocks are freed."""

    @abc.abstractmethod
    async def release_lease(self, ctx_request_id: str) -> bool:
        """Release the parked KV lease of a ``context_only`` request. False if there was none."""

    async def await_lease(self, disagg_request_id: str, timeout_s: float) -> object:
        """ctx, generation_first: wait (at most ``timeout_s``) until the context phase of
        ``disagg_request_id`` parked, finished or failed; returns a ``pdserve.kv_wait.LeaseWaitAnswer``.

        Raises:
            TimeoutError: no outcome within ``timeout_s``; the request's blocks are freed (abandoned).
            EngineDeadError: the engine is dead.
        """
        raise NotImplementedError(f"{type(self).__name__} has no lease waits")

    def kv_source_ready(self, request_id: str, params: "DisaggregatedParams") -> None:
        """gen, generation_first: hand the ctx server's params of an admitted ``generation_only``
        request to the worker side, which then pulls its KV."""
        raise NotImplementedError(f"{type(self).__name__} has no KV sources")

    @abc.abstractmethod
    def stats(self) -> dict:
        """Snapshot: ``free_blocks``, ``total_blocks`` and the role's KV counters."""

    @abc.abstractmethod
    async def fresh_stats(self) -> dict:
        """Like :meth:`stats`, but read from the engine now (a round trip in the lattice).

        Raises:
            TimeoutError: the engine did not answer within ``STATS_TIMEOUT_S`` (it answers between
                steps, and one long prefill step can take seconds): callers fall back to :meth:`stats`.
        """

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache block hash; the number of unreferenced cached blocks freed.

        Raises:
            EngineDeadError: the engine is dead.
            TimeoutError: the engine did not answer within a bounded wait (it answers between steps).
        """

    @abc.abstractmethod
    def drain(self, move_kv: bool = False) -> None:
        """Stop admitting new requests; in-flight ones finish, or (``move_kv``) the movable ones are
        moved off at their next decode step: their streams end with a ``moved`` event."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine loop (bounded wait) and fail whatever is pending."""
