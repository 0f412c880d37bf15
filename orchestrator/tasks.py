"""An owner for fire-and-forget background tasks (e.g. best-effort lease releases)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("orchestrator.tasks")


class TaskOwner:
    """Keeps a strong reference to each spawned task and stops them all at :meth:`close`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for running tasks, then cancel what is left."""
        if not self._tasks:
            return
        pending = set(self._tasks)
        _, still = await asyncio.wait(pending, timeout=timeout_s)
        for task in still:
            log.warning("cancelling background task %s at shutdown", task.get_name())
            task.cancel()
        if still:
            await asyncio.wait(still, timeout=timeout_s)


class LoopTask:
    """One long-running loop (a poller, a reconciler) with an explicit start and a cancelling stop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task | None = None

    def start(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as the loop; a second start while it runs closes ``coro`` unused."""
        if self._task is None:
            self._task = asyncio.create_task(coro, name=self.name)
        else:
            coro.close()

    async def stop(self) -> None:
        """Cancel the loop and wait for it to finish its cleanup."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
