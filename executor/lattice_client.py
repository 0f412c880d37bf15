"""The :class:`EngineClient` of one frontend of the lattice (frontend 0 or an attached one).

Each frontend PUSH-connects to rank 0's ingress and binds its own result lane (PULL). Commands are
:mod:`executor.messages` dataclasses, one signed pickle each; a receiver thread reads the lane
(verifying every message's HMAC; up to ``MAX_BATCH`` events per message) and hands each event to
:meth:`WorkerClient.dispatch`. A pidfd monitor on every rank makes the engine dead the moment a
rank exits; an ``EngineDead`` event from rank 0 or the exit of ``mpiexec`` do the same.
"""

from __future__ import annotations

import asyncio
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

RECV_POLL_MS = 200      # receiver thread re-checks its stop flag this often
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
                "ranks": self.info.ranks}

    async def shutdown(self) -> None:
        self._stop.set()
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
            for event in self.codec.try_decode(data) or ():
                self.dispatch(event)

    def _on_rank_death(self, rank: int, reason: str) -> None:
        self._die(reason)
