"""The :class:`EngineClient` of one frontend of the lattice (frontend 0 or an attached one).

Each frontend PUSH-connects to rank 0's ingress and binds its own result lane (PULL). Commands are
:mod:`executor.messages` dataclasses, one signed pickle each. The lane (verifying every
message's HMAC; up to ``MAX_BATCH`` events per message) is read by a receiver thread until the
server's event loop runs; then :meth:`LatticeClient.attach_loop` (a startup hook) stops the thread
and the loop reads the lane itself (``add_reader`` on the socket's FD), so an output reaches its
stream with one wake-up of the frontend instead of two (receiver thread, then the loop). Each
event goes to :meth:`WorkerClient.dispatch`. A pidfd monitor on every rank makes the engine dead the moment a
rank exits; an ``EngineDead`` event from rank 0 or the exit of ``mpiexec`` do the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import zmq

from executor.engine_client import EngineNotServingError, EngineState
from executor.ipc import Codec
from executor.messages import Command, Shutdown
from executor.monitor import RankMonitor
from executor.proxy import AttachInfo, StartupError
from executor.worker_client import WorkerClient

log = logging.getLogger(__name__)

RECV_POLL_MS = 200      # receiver thread re-checks its stop flag this often; the loop reader re-checks the lane
SEND_HWM = 100_000      # queued messages to rank 0 before a send is refused (never blocks)


class LatticeClient(WorkerClient):
    """Submit/abort/stream over the IPC lanes of one server's worker ranks."""

    def __init__(self, info: AttachInfo, tokenizer) -> None:
        super().__init__(info.frontend_id, EngineState.SERVING)
        self.info = info
        self._tokenizer = tokenizer
        self.codec = Codec(bytes.fromhex(info.key_hex))
        self.zctx = zmq.Context()
        self.push = self.zctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.push.connect(info.ingress_addr)
        self.pull = self.zctx.socket(zmq.PULL)
        self.pull.bind(info.lane_addrs[self.frontend_id])
        self._stop = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name=f"lane{self.frontend_id}-receiver", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by attach_loop: the loop reads the lane
        self._recheck: asyncio.TimerHandle | None = None
        try:
            self.monitor = RankMonitor(info.rank_processes(), self._on_rank_death)
        except ProcessLookupError as err:
            self.zctx.destroy(linger=0)
            raise StartupError(f"a worker rank exited right after start-up: {err}") from None

    def start(self) -> None:
        self._receiver.start()
        self.monitor.start()

    # ---- EngineClient ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.info.worker_info["max_model_len"])

    def _stats_extra(self) -> dict:
        return {"ipc_rejected_frontend": self.codec.rejected, "frontend_id": self.frontend_id,
                "lane_reader": "loop" if self._loop is not None else "thread",
                "ranks": self.info.ranks}

    def attach_loop(self) -> None:
        """From now on the running event loop reads the lane (call in that loop, once: the server's
        startup hook). Stops the receiver thread first (at most RECV_POLL_MS), so one thread at a
        time owns the socket; messages that arrive meanwhile wait in the socket."""
        if self._loop is not None:
            return
        loop = asyncio.get_running_loop()
        self._stop.set()
        if self._receiver.is_alive():
            self._receiver.join(2 * RECV_POLL_MS / 1000)
        if self._receiver.is_alive():
            raise RuntimeError("the lane's receiver thread did not stop")
        self._stop.clear()
        self._loop = loop
        loop.add_reader(self.pull.getsockopt(zmq.FD), self._drain_lane)
        loop.call_soon(self._drain_lane)  # after what the thread already queued on the loop: order kept

    def _drain_lane(self) -> None:
        """Loop reader: every message the lane holds now (the FD signals edges: zmq.EVENTS is read
        until it shows no message), then a re-check in RECV_POLL_MS as a safety net."""
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        if self._stop.is_set():
            return
        failed = False
        try:
            while self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._dispatch_message(self.pull.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass
        except zmq.ZMQError as err:
            failed = True
            log.error("result lane failed: %s", err)
            self._detach()
        finally:  # a dispatch that raised still leaves the rest of the lane to the re-check
            if not failed and not self._stop.is_set():
                self._recheck = self._loop.call_later(RECV_POLL_MS / 1000, self._drain_lane)

    def _detach(self) -> None:
        """Stop the loop reader (loop thread)."""
        if self._loop is None:
            return
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        with contextlib.suppress(zmq.ZMQError, ValueError, OSError):
            self._loop.remove_reader(self.pull.getsockopt(zmq.FD))

    async def shutdown(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._detach()
        elif self._receiver.is_alive():
            await asyncio.to_thread(self._receiver.join, 2.0)
        self.monitor.stop()
        self._die("the server is shutting down", log_error=False)
        self.zctx.destroy(linger=500)

    def send_engine_shutdown(self) -> None:
        """Ask rank 0 to stop serving (frontend 0 only, at server shutdown)."""
        if self.frontend_id != 0:
            raise RuntimeError("only frontend 0 may shut the engine down")
        self._send(Shutdown("frontend 0 is shutting the server down"))

    def die_if_alive(self, reason: str) -> None:
        """Make the engine dead unless it already is or the server is shutting down."""
        if not self._stop.is_set():
            self._die(reason)

    def _send(self, cmd: Command) -> None:
        try:
            self.push.send(self.codec.encode(cmd), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineNotServingError(f"{SEND_HWM} messages are queued for the worker; refusing more") from None

    # ---- receiver thread ------------------------------------------------------------------
    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.pull.poll(RECV_POLL_MS):
                    continue
                data = self.pull.recv()
            except zmq.ZMQError as err:
                if not self._stop.is_set():
                    log.error("result lane failed: %s", err)
                return
            self._dispatch_message(data)

    def _dispatch_message(self, data: bytes) -> None:
        for event in self.codec.try_decode(data) or ():
            self.dispatch(event)

    def _on_rank_death(self, rank: int, reason: str) -> None:
        self._die(reason)
