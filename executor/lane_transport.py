"""Rank 0's transport for the engine loop: request ingress, per-frontend response lanes, wake-ups.

Sockets (all ``ipc://`` in the server's private directory):
- ingress: PULL bound here; every frontend PUSH-connects to it; one signed command per message;
- lanes: one PUSH per frontend, connected to the PULL that frontend binds; events are fused, up to
  ``MAX_BATCH`` per message (a list);
- wake: an inproc PUSH/PULL pair through which role threads (KV pulls, lease timer) end a wait.

The ranks run in their own session: if frontend 0 dies without a ``Shutdown`` (kill -9) nobody
would stop them, so this transport also watches frontend 0's pidfd and turns its exit into a
``Shutdown`` command.
"""

from __future__ import annotations

import logging
import os
import threading

import zmq

from executor.ipc import MAX_BATCH, Codec
from executor.messages import COMMANDS, Command, EngineDead, Event, Shutdown
from executor.monitor import proc_start_time

log = logging.getLogger(__name__)


class LaneTransport:
    """The zmq side of rank 0 (see the module docstring). Owned by the worker; :meth:`close` ends it."""

    def __init__(self, codec: Codec, ingress_addr: str, lane_addrs: list[str],
                 frontend: tuple[int, int | None] | None = None) -> None:
        self.codec = codec
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
        self.num_lanes = len(self.lanes)
        self._wake_pull = self.zctx.socket(zmq.PULL)
        self._wake_pull.bind("inproc://wake")
        self._wake_push = self.zctx.socket(zmq.PUSH)
        self._wake_push.connect("inproc://wake")
        self._wake_lock = threading.Lock()  # zmq sockets are not thread-safe; many threads wake
        self._frontend_fd = _pidfd(*frontend) if frontend else None
        self.frontend_exited = False  # frontend 0 died without a Shutdown: nobody else cleans up after it
        self._poller = zmq.Poller()
        self._poller.register(self.ingress, zmq.POLLIN)
        self._poller.register(self._wake_pull, zmq.POLLIN)
        if self._frontend_fd is not None:
            self._poller.register(self._frontend_fd, zmq.POLLIN)

    def receive(self, timeout_s: float) -> list[Command]:
        """Wait at most ``timeout_s`` for the ingress, a wake-up or frontend 0's exit; read every command."""
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._frontend_fd is not None and self._frontend_fd in events:
            log.error("frontend 0 exited without shutting the engine down; stopping")
            self.frontend_exited = True
            return [Shutdown("frontend 0 exited")]
        if self._wake_pull in events:
            while self._wake_pull.poll(0):
                self._wake_pull.recv()
        return self._read_ingress() if self.ingress in events else []

    def _read_ingress(self) -> list[Command]:
        commands = []
        while True:
            try:
                data = self.ingress.recv(zmq.NOBLOCK)
            except zmq.Again:
                return commands
            msg = self.codec.try_decode(data)
            if isinstance(msg, COMMANDS):
                commands.append(msg)
            elif msg is not None:
                log.warning("ignoring an IPC message that is not a command: %s", type(msg).__name__)

    def wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the loop is already flooded with wake-ups

    def send(self, lane: int, events: list[Event]) -> None:
        for i in range(0, len(events), MAX_BATCH):
            self.lanes[lane].send(self.codec.encode(events[i:i + MAX_BATCH]))

    def report_dead(self, reason: str) -> None:
        """Tell every frontend the engine died (best effort, before the rank exits)."""
        for lane in self.lanes:
            try:
                lane.send(self.codec.encode([EngineDead(reason)]), zmq.NOBLOCK)
            except zmq.ZMQError as err:
                log.warning("could not report the death on a lane: %s", err)

    def stats(self) -> dict:
        return {"ipc_rejected_worker": self.codec.rejected}

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
