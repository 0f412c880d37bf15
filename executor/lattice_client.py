"""The :class:`EngineClient` of one frontend of the lattice (frontend 0 or an attached one).

Each frontend PUSH-connects to rank 0's ingress and binds its own result lane (PULL). A receiver
thread reads the lane (verifying every message's HMAC) and hands items to the asyncio queues of
the requests this frontend submitted. A pidfd monitor on every rank makes the engine dead the
moment a rank exits; a ``dead`` message from rank 0 or the exit of ``mpiexec`` do the same.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator

import zmq

from engine.request import EngineRequest
from executor.engine_client import EngineClient, EngineDeadError, EngineNotServingError, EngineState
from executor.ipc import Codec, make_client_id
from executor.streams import StreamRegistry
from executor.monitor import RankMonitor
from executor.proxy import AttachInfo, StartupError
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)

RECV_POLL_MS = 200      # receiver thread re-checks its stop flag this often
REPLY_TIMEOUT_S = 10.0  # a control call (lease release) waits at most this long for rank 0
STATS_TIMEOUT_S = 1.0  # fresh stats: /metrics and /server_info answer with the pushed snapshot after this
SEND_HWM = 100_000      # queued messages to rank 0 before a send is refused (never blocks)


class LatticeClient(EngineClient):
    """Submit/abort/stream over the IPC lanes of one server's worker ranks."""

    def __init__(self, info: AttachInfo, tokenizer) -> None:
        self.info = info
        self.frontend_id = info.frontend_id
        self._tokenizer = tokenizer
        self.codec = Codec(bytes.fromhex(info.key_hex))
        self.zctx = zmq.Context()
        self.push = self.zctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.push.connect(info.ingress_addr)
        self.pull = self.zctx.socket(zmq.PULL)
        self.pull.bind(info.lane_addrs[self.frontend_id])
        self._seq = itertools.count(1)
        self._requests = StreamRegistry(EngineState.SERVING)
        self._calls: dict[int, asyncio.Future] = {}
        self._stats: dict = {"free_blocks": 0, "total_blocks": 0}
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
    def state(self) -> EngineState:
        return self._requests.state

    @property
    def dead_reason(self) -> str | None:
        return self._requests.dead_reason

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.info.worker_info["max_model_len"])

    def stats(self) -> dict:
        return {**self._stats, "ipc_rejected_frontend": self.codec.rejected, "frontend_id": self.frontend_id,
                "ranks": self.info.ranks}

    async def generate(self, request: EngineRequest,
                       disagg: DisaggregatedParams | None = None) -> AsyncIterator[object]:
        stream = self._requests.register(request.request_id)
        self._send(("add", make_client_id(self.frontend_id, next(self._seq)), request, disagg))
        async for item in self._requests.consume(request.request_id, stream, self.abort):
            yield item

    def abort(self, request_id: str) -> None:
        if self.state != EngineState.DEAD:
            self._send(("abort", request_id))

    async def release_lease(self, ctx_request_id: str) -> bool:
        if self.state == EngineState.DEAD:
            return False
        return bool(await self._call("release", ctx_request_id))

    async def fresh_stats(self) -> dict:
        if self.state == EngineState.DEAD:
            return self.stats()
        return {**await self._call("stats", timeout_s=STATS_TIMEOUT_S), "ipc_rejected_frontend": self.codec.rejected,
                "frontend_id": self.frontend_id, "ranks": self.info.ranks}

    async def _call(self, kind: str, *args: object, timeout_s: float = REPLY_TIMEOUT_S) -> object:
        """A request/reply with rank 0, bounded by ``timeout_s`` (raises TimeoutError)."""
        call_id = make_client_id(self.frontend_id, next(self._seq))
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send((kind, call_id, call_id, *args))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def drain(self) -> None:
        self._requests.transition(EngineState.SERVING, EngineState.DRAINING)
        self._send(("drain",))

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
        self._send(("shutdown",))

    def die_if_alive(self, reason: str) -> None:
        """Make the engine dead unless it already is or the server is shutting down."""
        if not self._stop.is_set():
            self._die(reason)

    def _send(self, msg: tuple) -> None:
        try:
            self.push.send(self.codec.encode(msg), zmq.NOBLOCK)
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
            items = self.codec.try_decode(data)
            for item in items or ():
                self._dispatch(item)

    def _dispatch(self, item: tuple) -> None:
        kind = item[0]
        if kind == "out":
            stream = self._requests.get(item[1])
            if stream is not None:
                stream.put(item[2])
        elif kind == "stats":
            self._stats = item[1]
            if item[1].get("state") == EngineState.DRAINING.value:
                self._requests.transition(EngineState.SERVING, EngineState.DRAINING)
        elif kind == "reply":
            fut = self._calls.get(item[1])
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(lambda: fut.done() or fut.set_result(item[2]))
        elif kind == "dead":
            self._die(item[1])

    def _on_rank_death(self, rank: int, reason: str) -> None:
        self._die(reason)

    def _die(self, reason: str, log_error: bool = True) -> None:
        """Dead for good (sticky): fail every pending request and control call, refuse new ones."""
        self._requests.die(reason, log_error)
        error = EngineDeadError(f"engine is dead: {self.dead_reason}")
        for fut in list(self._calls.values()):
            fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(error))
