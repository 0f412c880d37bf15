"""pidfd liveness monitor of a server's worker ranks.

One pidfd per local rank (``os.pidfd_open``, Linux ≥ 5.3) polled by one thread: the kernel makes a
pidfd readable the moment its process exits, so a death is seen at once, without polling
intervals. Each pid is validated against the start time in ``/proc/PID/stat`` (field 22, clock
ticks since boot; proc(5)) so that a recycled pid cannot pass for a live rank.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pdserve.procfs import proc_start_time  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankProcess:
    """A worker rank as reported in its READY message."""

    rank: int
    pid: int
    start_time: int


class RankMonitor:
    """Calls ``on_death(rank, reason)`` once, from its thread, when any watched rank exits.

    Raises ProcessLookupError at construction if a rank is already gone or its pid was recycled.
    """

    def __init__(self, ranks: list[RankProcess], on_death: Callable[[int, str], None]) -> None:
        self._on_death = on_death
        self._fds: dict[int, RankProcess] = {}
        for r in ranks:
            fd = os.pidfd_open(r.pid)
            if proc_start_time(r.pid) != r.start_time:  # checked after opening: the fd pins this process
                os.close(fd)
                self.close()
                raise ProcessLookupError(f"rank {r.rank} (pid {r.pid}) is gone or its pid was reused")
            self._fds[fd] = r
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="rank-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        for fd in (*self._fds, self._wake_r):
            poller.register(fd, select.POLLIN)
        while True:
            events = poller.poll()  # no timeout needed: stop() writes to the wake pipe
            for fd, _ in events:
                if fd == self._wake_r:
                    return
                r = self._fds[fd]
                log.error("worker rank %d (pid %d) exited", r.rank, r.pid)
                self._on_death(r.rank, f"worker rank {r.rank} (pid {r.pid}) died")
                return

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(timeout_s)
        self.close()

    def close(self) -> None:
        for fd in list(self._fds):
            os.close(fd)
        self._fds.clear()
        for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = None
