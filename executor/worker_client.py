"""The frontend half of the engine-loop protocol, shared by both :class:`EngineClient` implementations.

A :class:`WorkerClient` turns the EngineClient calls into :mod:`executor.messages` commands (sent
by the subclass's ``_send``: a queue in process, a zmq PUSH in the lattice) and routes the engine
loop's events back: outputs to the request's stream, replies to the waiting control call, stats
snapshots to :meth:`stats`, KV event batches to :attr:`kv_events` (the frontend's
:class:`executor.kv_event_hub.KVEventHub`), ``EngineDead`` to the sticky dead state. :meth:`dispatch` is
thread-safe (called by a lane's receiver thread or by the in-process loop thread).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from executor.engine_client import EngineClient, EngineDeadError, EngineNotServingError, EngineState
from executor.ipc import make_client_id
from executor.kv_event_hub import KVEventHub
from executor.messages import (AbortRequest, AddRequest, AwaitLease, CancelLeaseWait, Command, Drain, EngineDead, Event,
                               KVEvents, KVSnapshotQuery, KVSourceReady, Output, ReleaseLease, Reply, ResetPrefixCache,
                               StatsQuery, StatsSnapshot)
from executor.streams import StreamRegistry

if TYPE_CHECKING:
    from engine.request import EngineRequest
    from pdserve.kv_events import KVSnapshot
    from pdserve.protocol import DisaggregatedParams

REPLY_TIMEOUT_S = 10.0  # a control call (lease release) waits at most this long for the engine loop
STATS_TIMEOUT_S = 1.0   # fresh stats: /metrics and /server_info answer with the pushed snapshot after this


class WorkerClient(EngineClient):
    """Streams, control calls and the stats snapshot of one frontend (lane ``frontend_id``)."""

    def __init__(self, frontend_id: int, state: EngineState) -> None:
        self.frontend_id = frontend_id
        self._seq = itertools.count(1)
        self._requests = StreamRegistry(state)
        self._calls: dict[int, asyncio.Future] = {}
        self._stats: dict = {"free_blocks": 0, "total_blocks": 0}
        self.kv_events = KVEventHub()

    @abc.abstractmethod
    def _send(self, cmd: Command) -> None:
        """Hand ``cmd`` to the engine loop. Raises EngineNotServingError when it cannot be queued."""

    def _stats_extra(self) -> dict:
        """Frontend-side keys added to every stats answer."""
        return {}

    # ---- EngineClient ---------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._requests.state

    @property
    def dead_reason(self) -> str | None:
        return self._requests.dead_reason

    def stats(self) -> dict:
        return {**self._stats, **self._stats_extra(), **self.kv_events.stats()}

    async def generate(self, request: "EngineRequest",
                       disagg: "DisaggregatedParams | None" = None) -> AsyncIterator[object]:
        stream = self._requests.register(request.request_id)
        try:
            self._send(AddRequest(make_client_id(self.frontend_id, next(self._seq)), request, disagg))
        except EngineNotServingError as err:
            stream.put(err)  # raised by consume(), which also forgets the stream
        async for item in self._requests.consume(request.request_id, stream, self.abort):
            yield item

    def abort(self, request_id: str) -> None:
        if self.state != EngineState.DEAD:
            self._send(AbortRequest(request_id))

    async def release_lease(self, ctx_request_id: str) -> bool:
        if self.state == EngineState.DEAD:
            return False
        return bool(await self._call(lambda call_id: ReleaseLease(call_id, ctx_request_id)))

    async def fresh_stats(self) -> dict:
        if self.state == EngineState.DEAD:
            return self.stats()
        return {**await self._call(StatsQuery, timeout_s=STATS_TIMEOUT_S), **self._stats_extra(),
                **self.kv_events.stats()}

    async def reset_prefix_cache(self) -> int:
        if self.state == EngineState.DEAD:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")
        return int(await self._call(ResetPrefixCache))

    async def kv_snapshot(self) -> "KVSnapshot":
        """Every block hash the prefix cache holds, valid at its ``seq``: every batch up to it has
        reached :attr:`kv_events` when this returns. Raises EngineDeadError, TimeoutError."""
        if self.state == EngineState.DEAD:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")
        return await self._call(KVSnapshotQuery)  # type: ignore[return-value]

    async def await_lease(self, disagg_request_id: str, timeout_s: float) -> object:
        if self.state == EngineState.DEAD:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")
        call_id = make_client_id(self.frontend_id, next(self._seq))
        abandon = False
        try:
            return await self._call(lambda _: AwaitLease(call_id, disagg_request_id), timeout_s, call_id)
        except TimeoutError:
            abandon = True  # the waiter's time is up: nobody will pull, free the blocks
            raise
        finally:
            if self.state != EngineState.DEAD:  # answered, timed out or cancelled: forget the wait
                with contextlib.suppress(EngineNotServingError):  # a full queue: the wait expires with its outcome
                    self._send(CancelLeaseWait(call_id, disagg_request_id, abandon))

    def kv_source_ready(self, request_id: str, params: "DisaggregatedParams") -> None:
        if self.state != EngineState.DEAD:
            self._send(KVSourceReady(request_id, params))

    async def _call(self, make: Callable[[int], Command], timeout_s: float = REPLY_TIMEOUT_S,
                    call_id: int | None = None) -> object:
        """A request/reply with the engine loop: ``make(call_id)`` is the command; bounded by
        ``timeout_s`` (raises TimeoutError; EngineDeadError if the engine dies meanwhile)."""
        call_id = make_client_id(self.frontend_id, next(self._seq)) if call_id is None else call_id
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(make(call_id))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def drain(self, move_kv: bool = False) -> None:
        self._requests.transition(EngineState.SERVING, EngineState.DRAINING)
        self._send(Drain(move_kv))

    # ---- events from the engine loop (any thread) -----------------------------------------
    def dispatch(self, event: Event) -> None:
        """Route one event of the engine loop."""
        if isinstance(event, Output):
            stream = self._requests.get(event.request_id)
            if stream is not None:
                stream.put(event.item)
        elif isinstance(event, KVEvents):
            self.kv_events.publish(event.batch)
        elif isinstance(event, StatsSnapshot):
            self._stats = event.stats
            if event.stats.get("state") == EngineState.DRAINING.value:
                self._requests.transition(EngineState.SERVING, EngineState.DRAINING)
        elif isinstance(event, Reply):
            fut = self._calls.get(event.call_id)
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(lambda: fut.done() or fut.set_result(event.value))
        elif isinstance(event, EngineDead):
            self._die(event.reason)

    def _die(self, reason: str, log_error: bool = True) -> None:
        """Dead for good (sticky): fail every pending request and control call, refuse new ones."""
        self._requests.die(reason, log_error)
        error = EngineDeadError(f"engine is dead: {self.dead_reason}")
        for fut in list(self._calls.values()):
            fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(error))
