"""The one engine loop: commands in, engine steps, role hooks, events out — over any transport.

Both executors run this loop: the in-process executor in a thread of the HTTP process over an
in-thread queue (:class:`executor.inproc_executor.QueueTransport`), and rank 0 of the lattice over
the zmq lanes (:class:`executor.lane_transport.LaneTransport`). Messages are the dataclasses of
:mod:`executor.messages`. One iteration:

1. wait for commands (bounded: at once when the engine can step, else up to ``idle_wait_s``;
   any command or post ends the wait early) and apply them in arrival order;
2. run the posted callbacks (role threads: ``kv_ready``, ``release_parked``, deliveries);
3. step the engine, unless stopping: ``on_pull`` for each KV pull, then the posts, then for each
   output ``on_output``, the posts it caused, then the output itself;
4. push a stats snapshot if it changed (at most every ``stats_period_s``; a state change at once);
5. push the iteration's KV events (one numbered batch, :mod:`pdserve.kv_events`) to every lane;
6. send every lane its events, in the order they were produced.

Ordering rules (tested on both transports in ``tests/executor/test_engine_loop.py``):

- Commands are applied only between engine steps, in the order one frontend sent them (across
  frontends no order is promised). A posted callback runs on this thread, between steps or between
  the hook calls of one step, in the order it was posted.
- A request's items reach its stream in the order they were produced; an item a role delivers
  from ``on_output`` (a ctx ``KVHandoff``) precedes that output, so it precedes the final output.
- The final output or an exception item ends a request's stream: later items for it (a late
  ``kv_ready`` abort, a delivery after an abort) are dropped.
- An abort of an unknown or finished request id is a no-op; one the role is still copying KV for
  is deferred by the role (``intercept_abort``) until the copy stops writing.
- An add while draining is answered with ``EngineNotServingError``; an add the engine refuses
  (``ValueError``) with that error; neither touches other requests.
- Replies (lease release, stats) go to the caller's lane in the same flush as the outputs produced
  before them. A KV snapshot reply follows every KV event batch it covers (pending events are
  pushed as a batch first), so a frontend that sees the reply has seen every batch up to its ``seq``.
- When the engine has work but its last step could not schedule anything (requests waiting for
  blocks while nothing runs, requests waiting for their KV pull) and nothing arrived since, the
  loop waits (bounded) instead of polling: only a command or a post can change that.
- A ``Drain(move_kv=True)`` makes every later step first call ``engine.move_out()``: a movable
  request at a decode step boundary finishes with reason ``moved`` (the role parks its blocks and
  delivers the hand-off before that final output), so a request that was still pulling or
  prefilling moves once it decodes.
- ``Shutdown`` ends the loop after the iteration it arrives in (no further step); the role is
  stopped when the loop ends, however it ends. A failing step propagates out of :meth:`run`;
  :meth:`run_or_report` turns it into an ``EngineDead`` event on every lane.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.request import RequestOutput
from engine.step_timing import LOOP_KINDS, StageClock
from executor.engine_client import EngineNotServingError, EngineState
from executor.ipc import lane_of
from executor.kv_role import RankShards, WorkerRole
from executor.messages import (AbortRequest, AddRequest, AwaitLease, CancelLeaseWait, Command, Drain, Event,
                               KVEvents, KVSnapshotQuery, KVSourceReady, Output, ReleaseLease, Reply,
                               ResetPrefixCache, Shutdown, StatsQuery, StatsSnapshot)

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1        # longest wait for a command while the engine cannot step (anything arriving ends it)
STATS_PERIOD_S = 0.25    # how often a changed stats snapshot is pushed to every lane
# The stages of one iteration timed by EngineLoop.clock: the wait for commands (0 when the engine
# can step), applying commands and posted callbacks, engine.step() (move_out included), the role's
# hooks and emits for the step's pulls and outputs, and pushing stats / KV events / every lane's
# events (encoding and sending included). Kept by kind: the step's (engine.step_timing), or idle.
LOOP_STAGES = ("wait", "commands", "step", "hooks", "flush")


class Transport(Protocol):
    """How the loop meets its frontends. ``wake`` is thread-safe; the rest runs on the loop thread."""

    num_lanes: int

    def receive(self, timeout_s: float) -> list[Command]:
        """Wait at most ``timeout_s`` (0 = do not wait) for a command or a wake-up; return what arrived."""

    def wake(self) -> None:
        """End a wait in :meth:`receive` now, or make the next one return at once (any thread)."""

    def send(self, lane: int, events: list[Event]) -> None:
        """Hand ``events`` to frontend ``lane``, in order."""

    def report_dead(self, reason: str) -> None:
        """Best effort: tell every frontend the engine died (the loop is gone afterwards)."""

    def stats(self) -> dict:
        """The transport's own counters (e.g. rejected messages), merged into every snapshot."""


class EngineLoop:
    """Owns the engine (single-threaded by contract) and the role's hooks; serves one transport.

    Constructing it starts the role (a role that cannot start fails here, before the loop serves).
    ``post`` and ``deliver`` are the role's :class:`executor.kv_role.WorkerOps` (thread-safe).
    """

    def __init__(self, engine: "LLMEngine", role: WorkerRole, transport: Transport, shards: RankShards,
                 idle_wait_s: float = IDLE_WAIT_S, stats_period_s: float = STATS_PERIOD_S) -> None:
        self.engine, self.role, self.transport = engine, role, transport
        self.idle_wait_s, self.stats_period_s = idle_wait_s, stats_period_s
        self.state = EngineState.SERVING
        self._posted: queue.Queue[Callable[[], None]] = queue.Queue()
        self._owner: dict[str, int] = {}                  # request id -> lane of its stream
        self._out: dict[int, list[Event]] = defaultdict(list)
        self._stopping = False
        self._stalled = False  # the last step could not schedule anything and nothing arrived since
        self._moving = False   # drained with move_kv: movable requests leave at their next decode step
        self._last_stats: dict | None = None
        self._last_stats_t = 0.0
        self.clock = StageClock(LOOP_STAGES, LOOP_KINDS)  # where an iteration's wall time goes (stats: loop_*)
        self._handlers: dict[type, Callable] = {
            AddRequest: self._add, AbortRequest: self._abort, ReleaseLease: self._release,
            StatsQuery: self._stats_query, ResetPrefixCache: self._reset_prefix_cache,
            KVSnapshotQuery: self._kv_snapshot, Drain: self._drain, Shutdown: self._shutdown,
            AwaitLease: self._await_lease, CancelLeaseWait: self._cancel_lease_wait,
            KVSourceReady: self._kv_source_ready}
        self.role.start(engine, self, shards)

    # ---- WorkerOps (thread-safe) ----------------------------------------------------------
    def post(self, fn: Callable[["LLMEngine"], None]) -> None:
        """Run ``fn(engine)`` on the loop thread, between steps."""
        self._posted.put(lambda: fn(self.engine))
        self.transport.wake()

    def deliver(self, request_id: str, item: object) -> None:
        """Queue ``item`` for the request's stream (dropped if the stream already ended)."""
        self._posted.put(lambda: self._emit(request_id, item))
        self.transport.wake()

    # ---- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until a :class:`Shutdown`. A failure propagates; the role is stopped either way."""
        try:
            clock = self.clock
            while not self._stopping:
                clock.start()
                can_step = self.engine.has_work() and not self._stalled
                commands = self.transport.receive(0.0 if can_step else self.idle_wait_s)
                clock.lap("wait")
                for cmd in commands:
                    self._apply(cmd)
                if self._run_posted() or commands:
                    self._stalled = False
                clock.lap("commands")
                kind = "idle"
                if not self._stopping and self.engine.has_work() and not self._stalled:
                    kind = self._step()
                self._push_stats()
                self._push_kv_events()
                self._flush()
                clock.lap("flush")
                clock.commit(kind)
        finally:
            self.role.stop()

    def run_or_report(self, what: str) -> bool:
        """:meth:`run`; on a failure log it and send ``EngineDead`` to every lane. False on failure."""
        try:
            self.run()
            return True
        except Exception as err:  # noqa: BLE001 - any failure of the loop makes the engine dead for good
            log.exception("%s failed", what)
            self.transport.report_dead(f"{what} failed: {type(err).__name__}: {err}")
            return False

    def _run_posted(self) -> int:
        n = 0
        while True:
            try:
                fn = self._posted.get_nowait()
            except queue.Empty:
                return n
            fn()
            n += 1

    def _step(self) -> str:
        """One engine step and its hooks; returns the step's kind (engine.step_timing.STEP_KINDS)."""
        if self._moving:  # every iteration: requests still pulling or prefilling move once they decode
            self.engine.move_out()
        result = self.engine.step()
        self.clock.lap("step")
        for pull in result.kv_pulls:
            self.role.on_pull(pull)
        ran = self._run_posted()  # a role may have queued items (e.g. a failure) for these requests
        for out in result.outputs:
            self.role.on_output(out)
            self._run_posted()  # a KVHandoff must reach the frontend before the final output
            self._emit(out.request_id, out)
        self._stalled = result.stalled and not ran
        self.clock.lap("hooks")
        return result.kind

    # ---- commands -------------------------------------------------------------------------
    def _apply(self, cmd: Command) -> None:
        handler = self._handlers.get(type(cmd))
        if handler is None:
            log.warning("ignoring an unknown command %r", type(cmd).__name__)
            return
        handler(cmd)

    def _add(self, cmd: AddRequest) -> None:
        rid = cmd.request.request_id
        self._owner[rid] = lane_of(cmd.client_id, self.transport.num_lanes)
        if self.state != EngineState.SERVING:
            self._emit(rid, EngineNotServingError(f"engine is {self.state.value}; not admitting new requests"))
            return
        try:
            self.role.on_submit(cmd.request, cmd.disagg)
            self.engine.add_request(cmd.request)
        except ValueError as err:  # RequestValidationError: this request only
            self._emit(rid, err)

    def _abort(self, cmd: AbortRequest) -> None:
        if not self.role.intercept_abort(cmd.request_id):
            self.engine.abort_request(cmd.request_id)

    def _release(self, cmd: ReleaseLease) -> None:
        self._reply(cmd.call_id, self.role.release(cmd.ctx_request_id))

    def _stats_query(self, cmd: StatsQuery) -> None:
        self._reply(cmd.call_id, self._stats())

    def _reset_prefix_cache(self, cmd: ResetPrefixCache) -> None:
        self._reply(cmd.call_id, self.engine.reset_prefix_cache())

    def _kv_snapshot(self, cmd: KVSnapshotQuery) -> None:
        self._push_kv_events()  # the snapshot's seq must cover everything it holds
        self._reply(cmd.call_id, self.engine.kv_snapshot())

    def _await_lease(self, cmd: AwaitLease) -> None:
        # The role calls the reply on this thread (now, or from a later on_output): it lands in
        # the same flush as the outputs of that step.
        self.role.await_lease(cmd.disagg_request_id, cmd.call_id, lambda value: self._reply(cmd.call_id, value))

    def _cancel_lease_wait(self, cmd: CancelLeaseWait) -> None:
        self.role.cancel_lease_wait(cmd.disagg_request_id, cmd.call_id, cmd.abandon)

    def _kv_source_ready(self, cmd: KVSourceReady) -> None:
        self.role.kv_source_ready(cmd.request_id, cmd.params)

    def _drain(self, cmd: Drain) -> None:
        if self.state == EngineState.SERVING:
            self.state = EngineState.DRAINING
            self._last_stats = None  # push the new state at once
        if cmd.move_kv and not self.role.can_move_kv:
            log.warning("drain with move_kv: the %s role cannot park moved KV; in-flight requests finish here",
                        self.role.name)
        elif cmd.move_kv and self.state == EngineState.DRAINING and not self._moving:
            log.info("draining by moving KV: movable requests leave at their next decode step")
            self._moving = True
            self._stalled = False

    def _shutdown(self, cmd: Shutdown) -> None:
        log.info("engine loop stopping: %s", cmd.reason)
        self._stopping = True

    # ---- events ---------------------------------------------------------------------------
    def _reply(self, call_id: int, value: object) -> None:
        self._out[lane_of(call_id, self.transport.num_lanes)].append(Reply(call_id, value))

    def _emit(self, request_id: str, item: object) -> None:
        lane = self._owner.get(request_id)
        if lane is None:
            return  # the request already ended (e.g. aborted): nobody is listening
        self._out[lane].append(Output(request_id, item))
        if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
            del self._owner[request_id]

    def _push_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_t < self.stats_period_s and self._last_stats is not None:
            return
        stats = self._stats(timing=False)  # the loop clock moves even while idle: not a change
        self._last_stats_t = now
        if stats != self._last_stats:
            self._last_stats = stats
            snapshot = {**stats, **self.clock.snapshot("loop")}
            for lane in range(self.transport.num_lanes):
                self._out[lane].append(StatsSnapshot(snapshot))

    def _push_kv_events(self) -> None:
        batch = self.engine.take_kv_events()
        if batch is not None:
            for lane in range(self.transport.num_lanes):
                self._out[lane].append(KVEvents(batch))

    def _stats(self, timing: bool = True) -> dict:
        stats = {**self.engine.stats(), "running_requests": len(self._owner), "state": self.state.value,
                 **self.transport.stats(), **self.role.stats()}
        return {**stats, **self.clock.snapshot("loop")} if timing else stats

    def _flush(self) -> None:
        for lane, events in self._out.items():
            if events:
                self.transport.send(lane, events)
        self._out.clear()
