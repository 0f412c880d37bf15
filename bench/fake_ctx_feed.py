"""The fake workers' cheap generation_first signal: the ctx worker pushes "parked" to the gen worker.

The real gen server asks the ctx server once per request (``POST /disagg/lease``, a waiting pull:
:mod:`pdserve.kv_wait`). In the overhead bench both fake workers and the client share one core,
so each such wait (an HTTP request parsed and answered by the ctx fake, sent and read by the gen
fake) is CPU spent on that core in the very window the router's TTFT is measured in — the servers'
cost, charged to the router. ``--ctx-signal push`` replaces it with the other design the issue
names, a push notification, at a fraction of the cost, and the gen fake still waits for it:

- the gen worker subscribes once per ctx worker (``POST /disagg/parked_feed``, a long-lived NDJSON
  answer; :class:`ParkedFeeds`) and keeps one future per ``disagg_request_id``;
- the ctx worker writes one line ``{"disagg_request_id", "state": "parked", "disaggregated_params"}``
  to every subscriber as soon as its ``context_only`` answer is made (:class:`ParkedPublisher`),
  after replaying the outcomes it already had when the subscription began (a request whose ctx
  answer came before the subscription is not lost);
- a gen request streams only once its line came (at most ``wait_s``; a broken feed fails its
  waiters at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

log = logging.getLogger("fake_ctx_feed")

FEED_PATH = "/disagg/parked_feed"
MAX_PARKED = 10_000  # gen side: outcomes kept per ctx worker for requests still to come (oldest dropped)

Send = Callable[[dict], Awaitable[None]]


class ParkedPublisher:
    """ctx side: the subscribers of ``POST /disagg/parked_feed`` and the lines they get."""

    def __init__(self) -> None:
        self._subscribers: list[Send] = []

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    async def serve(self, receive, send: Send, done: list[dict]) -> None:
        """Answer one subscription until its client leaves; ``done``: outcomes to replay first
        (``{"disagg_request_id", ...}`` each)."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        replay = b"".join(json.dumps(o).encode() + b"\n" for o in done)
        await send({"type": "http.response.body", "body": replay, "more_body": True})
        self._subscribers.append(send)
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            self._subscribers.remove(send)

    async def publish(self, outcome: dict) -> None:
        """Write ``outcome`` (one line) to every subscriber; one whose connection broke is dropped."""
        line = json.dumps(outcome).encode() + b"\n"
        for send in list(self._subscribers):
            try:
                await send({"type": "http.response.body", "body": line, "more_body": True})
            except OSError as err:  # the subscriber left mid-write: its serve() ends on the disconnect
                log.warning("parked feed subscriber dropped: %s", err)
                if send in self._subscribers:
                    self._subscribers.remove(send)


class ParkedFeeds:
    """gen side: one subscription per ctx worker, read by a task this object owns (:meth:`close`
    stops them), and the outcome future of each ``disagg_request_id``.

    ``client``: an :class:`orchestrator.h1client.H1Client` (made in the serving loop)."""

    def __init__(self, client) -> None:
        self._client = client
        self._readers: dict[str, asyncio.Task] = {}
        self._subscribed: dict[str, asyncio.Future] = {}
        self._outcomes: dict[str, OrderedDict[str, asyncio.Future]] = {}

    async def wait(self, ctx_url: str, disagg_id: str, wait_s: float) -> dict:
        """The outcome the ctx worker at ``ctx_url`` pushed for ``disagg_id``.

        Raises TimeoutError past ``wait_s``; ConnectionError when the feed broke."""
        async with asyncio.timeout(wait_s):
            await self._subscribe(ctx_url)
            fut = self._future(ctx_url, disagg_id)
            try:
                return await fut
            finally:
                self._outcomes.get(ctx_url, {}).pop(disagg_id, None)

    def _future(self, ctx_url: str, disagg_id: str) -> asyncio.Future:
        futures = self._outcomes.setdefault(ctx_url, OrderedDict())
        fut = futures.get(disagg_id)
        if fut is None:
            fut = futures[disagg_id] = asyncio.get_running_loop().create_future()
            while len(futures) > MAX_PARKED:
                futures.popitem(last=False)
        return fut

    async def _subscribe(self, ctx_url: str) -> None:
        if ctx_url not in self._readers:
            self._subscribed[ctx_url] = asyncio.get_running_loop().create_future()
            self._readers[ctx_url] = asyncio.get_running_loop().create_task(self._read(ctx_url),
                                                                             name=f"parked-feed-{ctx_url}")
        await asyncio.shield(self._subscribed[ctx_url])

    async def _read(self, ctx_url: str) -> None:
        subscribed = self._subscribed[ctx_url]
        resp = None
        try:
            resp = await self._client.post(ctx_url, FEED_PATH, b"{}")
            if resp.status != 200:
                raise ConnectionError(f"{ctx_url}{FEED_PATH} answered HTTP {resp.status}")
            subscribed.set_result(None)
            tail = b""
            while (chunk := await resp.next_chunk()) is not None:
                *lines, tail = (tail + chunk).split(b"\n")
                for line in lines:
                    outcome = json.loads(line)
                    fut = self._future(ctx_url, outcome["disagg_request_id"])
                    fut.done() or fut.set_result(outcome)
            raise ConnectionError(f"the parked feed of {ctx_url} ended")
        except Exception as err:  # noqa: BLE001 - every waiter of this ctx worker learns it, now
            log.warning("parked feed of %s broke: %s", ctx_url, err)
            self._fail(ctx_url, err if isinstance(err, ConnectionError) else ConnectionError(str(err)))
        finally:
            if resp is not None:
                resp.close()
            self._readers.pop(ctx_url, None)

    def _fail(self, ctx_url: str, err: ConnectionError) -> None:
        futures = [self._subscribed.pop(ctx_url, None), *self._outcomes.pop(ctx_url, OrderedDict()).values()]
        for fut in futures:
            if fut is not None and not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: a future nobody waits for logs no warning

    async def close(self) -> None:
        """Stop every reader task (and wait for them)."""
        tasks = list(self._readers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
