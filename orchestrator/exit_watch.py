"""Know the moment a launched server's process exits, instead of at the fleet's next poll.

:class:`ExitWatch` holds one pidfd per watched process (``os.pidfd_open``, Linux ≥ 5.3) on the
event loop: the fd turns readable when the process exits, and the callback (the fleet's wake-up)
runs at once. So a dead server (exit 75) is restarted right away rather than up to
``launcher.monitor_interval_s`` later; the fleet's poll stays the fallback (a process that is
already gone, no pidfd support, Slurm jobs that have no local pid).

Owner: :class:`orchestrator.fleet.Fleet` (one watch, on its loop); :meth:`close` removes every
reader and closes every fd.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

log = logging.getLogger("orchestrator.exit_watch")


class ExitWatch:
    """pidfds on the running event loop; each fires its callback once, when its process exits."""

    def __init__(self) -> None:
        self._fds: set[int] = set()

    def watch(self, pid: int, on_exit: Callable[[], None]) -> bool:
        """Call ``on_exit()`` on this loop when process ``pid`` exits. False when it cannot be
        watched (gone already, or no pidfd here): the caller's poll finds the exit instead."""
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError) as err:
            log.debug("no pidfd for pid %d (%s); the poll will see its exit", pid, err)
            return False
        loop = asyncio.get_running_loop()

        def fired() -> None:
            self._forget(loop, fd)
            on_exit()

        loop.add_reader(fd, fired)
        self._fds.add(fd)
        return True

    def _forget(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        """Stop watching everything (call on the loop that watches)."""
        loop = asyncio.get_running_loop()
        for fd in list(self._fds):
            self._forget(loop, fd)
