"""The rank-0 worker loop: request ingress, engine steps, per-frontend response lanes.

Sockets (all ``ipc://`` in the server's private directory):
- ingress: PULL bound here; every frontend PUSH-connects to it;
- lanes: one PUSH per frontend, connected to the PULL that frontend binds;
- wake: an inproc PUSH/PULL pair through which role threads (KV pulls, lease timer) wake the loop.

Frontend → worker messages: ``("add", client_id, EngineRequest, disagg)``, ``("abort", request_id)``,
``("release", client_id, call_id, ctx_request_id)``, ``("stats", client_id, call_id)``, ``("drain",)``,
``("shutdown",)``.
Worker → frontend messages: a list of up to ``MAX_BATCH`` items per zmq message, each
``("out", request_id, item)``, ``("reply", call_id, value)``, ``("stats", dict)`` or ``("dead", reason)``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import zmq

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput
from executor.engine_client import EngineNotServingError, EngineState
from executor.ipc import MAX_BATCH, Codec, lane_of
from executor.monitor import proc_start_time
from executor.kv_role import RankShards, WorkerRole

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100       # idle wait on ingress/wake (anything arriving wakes the loop at once)
STATS_PERIOD_S = 0.25    # how often a changed stats snapshot is pushed to every frontend


class WorkerLoop:
    """Owns the engine on rank 0 and serves every frontend through the IPC lanes."""

    def __init__(self, engine: LLMEngine, role: WorkerRole, codec: Codec, ingress_addr: str,
                 lane_addrs: list[str], shards: RankShards, frontend: tuple[int, int] | None = None) -> None:
        self.engine, self.role, self.codec, self.shards = engine, role, codec, shards
        self.zctx = zmq.Context()
        self.ingress = self.zctx.socket(zmq.PULL)
        self.ingress.bind(ingress_addr)
        self.lanes = []
        for addr in lane_addrs:
            s = self.zctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            s.setsockopt(zmq.SNDHWM, 0)  # never drop an output; frontends drain continuously
            s.connect(addr)
            self.lanes.append(s)
        self._wake_pull = self.zctx.socket(zmq.PULL)
        self._wake_pull.bind("inproc://wake")
        self._wake_push = self.zctx.socket(zmq.PUSH)
        self._wake_push.connect("inproc://wake")
        self._wake_lock = threading.Lock()
        self._posted: queue.Queue[Callable[[], None]] = queue.Queue()
        self._owner: dict[str, int] = {}               # request id -> lane
        self._out: dict[int, list] = defaultdict(list)  # lane -> items to send
        self.state = EngineState.SERVING
        self._stopping = False
        self._last_stats: dict | None = None
        self._last_stats_t = 0.0
        # The ranks run in their own session: if frontend 0 dies without a shutdown message (kill -9)
        # nobody would stop them, so rank 0 watches frontend 0's pidfd and stops with it.
        self._frontend_fd = _pidfd(*frontend) if frontend else None
        # Started here, before the rank reports READY: a role that cannot start (e.g. its KV
        # transceiver) is a start-up failure naming the rank, not a dead engine right after it.
        self.role.start(self.engine, self, self.shards)

    # ---- WorkerOps (thread-safe) ----------------------------------------------------------
    def post(self, fn: Callable[[LLMEngine], None]) -> None:
        self._posted.put(lambda: fn(self.engine))
        self._wake()

    def deliver(self, request_id: str, item: object) -> None:
        self._posted.put(lambda: self._emit(request_id, item))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the loop is already flooded with wake-ups

    # ---- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until a ``shutdown`` message. Exceptions propagate (the rank then exits non-zero)."""
        poller = zmq.Poller()
        poller.register(self.ingress, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        if self._frontend_fd is not None:
            poller.register(self._frontend_fd, zmq.POLLIN)
        try:
            while not self._stopping:
                busy = self.engine.has_work()
                events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
                if self._frontend_fd is not None and self._frontend_fd in events:
                    log.error("frontend 0 exited without shutting the engine down; stopping")
                    break
                if self._wake_pull in events:
                    while self._wake_pull.poll(0):
                        self._wake_pull.recv()
                if self.ingress in events:
                    self._read_ingress()
                self._run_posted()
                if self.engine.has_work() and not self._stopping:
                    self._step()
                self._push_stats()
                self._flush()
        finally:
            self.role.stop()

    def _read_ingress(self) -> None:
        while True:
            try:
                data = self.ingress.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.codec.try_decode(data)
            if msg is not None:
                self._handle(msg)

    def _run_posted(self) -> None:
        while True:
            try:
                fn = self._posted.get_nowait()
            except queue.Empty:
                return
            fn()

    def _step(self) -> None:
        result = self.engine.step()
        for pull in result.kv_pulls:
            self.role.on_pull(pull)
        self._run_posted()  # a role may have queued items (e.g. a failure) for these requests
        for out in result.outputs:
            self.role.on_output(out)
            self._run_posted()  # KVHandoff must reach the frontend before the final output
            self._emit(out.request_id, out)

    # ---- messages -------------------------------------------------------------------------
    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, client_id, request, disagg = msg
            self._add(lane_of(client_id, len(self.lanes)), request, disagg)
        elif kind == "abort":
            rid = msg[1]
            if not self.role.intercept_abort(rid):
                self.engine.abort_request(rid)
        elif kind == "release":
            _, client_id, call_id, ctx_request_id = msg
            self._out[lane_of(client_id, len(self.lanes))].append(("reply", call_id, self.role.release(ctx_request_id)))
        elif kind == "stats":
            _, client_id, call_id = msg
            self._out[lane_of(client_id, len(self.lanes))].append(("reply", call_id, self._stats()))
        elif kind == "drain":
            if self.state == EngineState.SERVING:
                self.state = EngineState.DRAINING
                self._last_stats = None  # push the new state at once
        elif kind == "shutdown":
            self._stopping = True
        else:
            log.warning("ignoring an unknown IPC message kind %r", kind)

    def _add(self, lane: int, request: EngineRequest, disagg) -> None:
        rid = request.request_id
        self._owner[rid] = lane
        if self.state != EngineState.SERVING:
            self._emit(rid, EngineNotServingError(f"engine is {self.state.value}; not admitting new requests"))
            return
        try:
            self.role.on_submit(request, disagg)
            self.engine.add_request(request)
        except ValueError as err:  # RequestValidationError: this request only
            self._emit(rid, err)

    def _emit(self, request_id: str, item: object) -> None:
        lane = self._owner.get(request_id)
        if lane is None:
            return  # the request already ended (e.g. aborted): nobody is listening
        self._out[lane].append(("out", request_id, item))
        if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
            del self._owner[request_id]

    def _push_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_t < STATS_PERIOD_S and self._last_stats is not None:
            return
        stats = self._stats()
        self._last_stats_t = now
        if stats != self._last_stats:
            self._last_stats = stats
            for lane in range(len(self.lanes)):
                self._out[lane].append(("stats", stats))

    def _stats(self) -> dict:
        return {**self.engine.stats(), "running_requests": len(self._owner), "state": self.state.value,
                "ipc_rejected_worker": self.codec.rejected, **self.role.stats()}

    def _flush(self) -> None:
        for lane, items in self._out.items():
            for i in range(0, len(items), MAX_BATCH):
                self.lanes[lane].send(self.codec.encode(items[i:i + MAX_BATCH]))
        self._out.clear()

    def broadcast_dead(self, reason: str) -> None:
        """Tell every frontend the engine died (best effort, before the rank exits)."""
        for lane in self.lanes:
            try:
                lane.send(self.codec.encode([("dead", reason)]), zmq.NOBLOCK)
            except zmq.ZMQError as err:
                log.warning("could not report the death on a lane: %s", err)

    def close(self) -> None:
        if self._frontend_fd is not None:
            os.close(self._frontend_fd)
        self.zctx.destroy(linger=1000)


def _pidfd(pid: int, start_time: int | None) -> int | None:
    """A pidfd of ``pid`` if it is still the process that started at ``start_time``, else None."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if start_time is not None and proc_start_time(pid) != start_time:
        os.close(fd)
        return None
    return fd
