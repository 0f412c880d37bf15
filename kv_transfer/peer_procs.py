"""Is the ctx process a same-host read targets still the one that answered? Cheaply, per read.

A same-host pull reads another process's memory by pid (``process_vm_readv``), and a pid can be
recycled. The answer names the process by pid *and* start time (``/proc/PID/stat`` field 22); reading
that file before and after each read cost 2 × 20–60 us of a 1 MiB pull's ~250 us budget. Instead a
pidfd (pidfd_open(2), Linux ≥ 5.3) is opened once per (pid, start time) and checked against the start
time once, right after opening: from then on the fd names that very process, and it turns readable
when the process exits (poll(2) on a pidfd), so "still alive" is one non-blocking poll.

Why the one check suffices: the fd refers to whichever process held the pid at ``pidfd_open``. If the
start time read *after* opening matches, that process was the named one at the time of the read,
and if the pid had been recycled in between, the start time would not match.
"""

from __future__ import annotations

import os
import select
import threading
from collections import OrderedDict

from pdserve.procfs import proc_start_time

MAX_WATCHED = 64


class PeerProcesses:
    """pidfds of the ctx processes this gen client reads from, LRU-bounded (thread-safe)."""

    def __init__(self, capacity: int = MAX_WATCHED) -> None:
        self._fds: OrderedDict[tuple[int, object], int] = OrderedDict()
        self._lock = threading.Lock()
        self._capacity = capacity

    def alive(self, pid: int, start_time: object) -> bool:
        """Whether ``pid`` still names the process that started at ``start_time`` (clock ticks; None:
        the peer sent none, only liveness of the pid is checked)."""
        key = (pid, start_time)
        with self._lock:
            if key not in self._fds:
                fd = None
            else:
                self._fds.move_to_end(key)
                return self._poll_locked(key)
        if fd is None and self._open(pid, start_time) is None:
            return False
        with self._lock:
            return key in self._fds and self._poll_locked(key)

    def _poll_locked(self, key: tuple[int, object]) -> bool:
        """Under the lock (so no other thread closes the fd mid-poll): alive, or dropped."""
        fd = self._fds[key]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):
            return True
        del self._fds[key]  # it exited: a later answer from this pid is another process
        os.close(fd)
        return False

    def _open(self, pid: int, start_time: object) -> int | None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None  # ESRCH: gone
        if start_time is not None and proc_start_time(pid) != start_time:
            os.close(fd)
            return None
        with self._lock:
            old = self._fds.pop((pid, start_time), None)
            self._fds[(pid, start_time)] = fd
            evicted = []
            while len(self._fds) > self._capacity:
                evicted.append(self._fds.popitem(last=False)[1])
        for stale in ([old] if old is not None else []) + evicted:
            os.close(stale)
        return fd

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)
