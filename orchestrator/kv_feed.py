"""Subscriptions to every accepted member's KV event stream (``GET /kv_events``, NDJSON).

:class:`KVEventFeeds` runs one reconcile loop (every ``interval_s`` seconds) that starts a
subscriber task for each ready or draining member and stops the task of a member that left or is
no longer accepted (its index is forgotten). A subscriber opens the stream, loads the snapshot
line into the member's :class:`orchestrator.kv_index.ServerKVIndex`, applies batches in order and
ignores heartbeats. Any irregularity drops the index at once (load-only scoring for that server)
and the subscriber reconnects after ``retry_s`` seconds, resynchronizing from a new snapshot:

* a batch with a ``seq`` gap or another epoch (:class:`orchestrator.kv_index.KVStreamGap`);
* a ``gap`` line (the server's buffer overflowed: this reader was too slow);
* the stream ending, a read timeout (``read_timeout_s``: no line, not even a heartbeat), a
  connection error, a malformed line, an HTTP status other than 200.

A member that answers 404 (it publishes no KV events) is retried every ``10 * retry_s``.
Owners: the subscriber tasks belong to the feeds' :class:`orchestrator.tasks.TaskOwner` and the
reconcile loop to a :class:`orchestrator.tasks.LoopTask`; :meth:`KVEventFeeds.stop` ends all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import httpx

from pdserve.kv_events import KVEventBatch, KVSnapshot, KVWireError, parse_line

from .kv_index import KVIndexes, KVStreamGap
from .pools import ClusterPools, ServerState
from .tasks import LoopTask, TaskOwner

log = logging.getLogger("orchestrator.kv_feed")

LineStream = AsyncIterator[str]
StreamOpener = Callable[[str], AbstractAsyncContextManager[LineStream]]  # member URL -> its lines

SUBSCRIBED_STATES = (ServerState.READY, ServerState.DRAINING)


class FeedRefused(Exception):
    """The member answered the subscription with an HTTP error (``status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"GET /kv_events answered HTTP {status}")
        self.status = status


def httpx_opener(client: httpx.AsyncClient, connect_timeout_s: float, read_timeout_s: float) -> StreamOpener:
    """Open ``GET {url}/kv_events`` on ``client``; every read waits at most ``read_timeout_s``."""
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)

    @contextlib.asynccontextmanager
    async def open_lines(url: str) -> AsyncIterator[LineStream]:
        async with client.stream("GET", f"{url}/kv_events", timeout=timeout) as resp:
            if resp.status_code != 200:
                raise FeedRefused(resp.status_code)
            yield resp.aiter_lines()

    return open_lines


class KVEventFeeds:
    """One subscriber per accepted member, feeding ``indexes`` (see the module docstring)."""

    def __init__(self, pools: ClusterPools, indexes: KVIndexes, open_lines: StreamOpener,
                 interval_s: float = 0.5, retry_s: float = 0.5) -> None:
        self._pools = pools
        self.indexes = indexes
        self._open = open_lines
        self._interval_s = interval_s
        self._retry_s = retry_s
        self._tasks = TaskOwner()
        self._subscribers: dict[str, asyncio.Task] = {}
        self._loop = LoopTask("orchestrator-kv-feeds")

    def start(self) -> None:
        self._loop.start(self._run())

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the reconcile loop and every subscriber (cancelled, then awaited up to ``timeout_s``)."""
        await self._loop.stop()
        for task in self._subscribers.values():
            task.cancel()
        self._subscribers.clear()
        await self._tasks.close(timeout_s)

    def subscribed(self) -> list[str]:
        """URLs with a running subscriber."""
        return list(self._subscribers)

    def reconcile(self) -> None:
        """Subscribe to each ready/draining member; unsubscribe (and forget the index of) the rest."""
        wanted = {s.url for s in self._pools.all_servers() if s.state in SUBSCRIBED_STATES}
        for url in [u for u in self._subscribers if u not in wanted or self._subscribers[u].done()]:
            task = self._subscribers.pop(url)
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("KV event subscriber of %s failed", url, exc_info=task.exception())
            task.cancel()
            self.indexes.forget(url)
        for url in self.indexes.urls():
            if url not in wanted:
                self.indexes.forget(url)
        for url in wanted - self._subscribers.keys():
            self._subscribers[url] = self._tasks.spawn(self._follow(url), name=f"kv-feed-{url}")

    async def _run(self) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(self._interval_s)

    async def _follow(self, url: str) -> None:
        """Subscribe to ``url`` until cancelled, resynchronizing after every irregularity."""
        last_reason = None
        while True:
            pause = self._retry_s
            try:
                await self._read(url)
                reason = "stream ended"
            except FeedRefused as err:
                reason = str(err)
                if err.status == 404:
                    pause = 10 * self._retry_s
            except (httpx.HTTPError, OSError, KVWireError, KVStreamGap) as err:
                reason = f"{type(err).__name__}: {err}"
            self.indexes.get(url).drop(reason)
            if reason != last_reason:
                log.info("KV events of %s: %s; resubscribing in %.1f s", url, reason, pause)
                last_reason = reason
            await asyncio.sleep(pause)

    async def _read(self, url: str) -> None:
        index = self.indexes.get(url)
        async with self._open(url) as lines:
            async for line in lines:
                if not line:
                    continue
                msg = parse_line(line)
                if isinstance(msg, KVSnapshot):
                    index.load_snapshot(msg)
                elif isinstance(msg, KVEventBatch):
                    index.apply(msg)
                elif msg[0] == "gap":
                    raise KVStreamGap(f"the server dropped events after batch {msg[2]} (reader too slow)")
