"""An :class:`EngineClient` that runs the engine loop in a thread of the server process.

Threads: the asyncio event loop (HTTP handlers) submits commands through a thread-safe queue; the
``engine-loop`` thread owns the :class:`engine.llm_engine.LLMEngine` (single-threaded by contract),
applies the commands between steps and hands each output to the request's asyncio queue with
``call_soon_threadsafe``. A failure of the loop makes the engine dead for good (sticky): every
pending request gets :class:`EngineDeadError` at once and new submits are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from executor.engine_client import EngineClient, EngineState
from executor.kv_role import RankShards, WorkerRole
from executor.streams import RequestStream, StreamRegistry
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the idle loop blocks on the command queue before re-checking stop


class InProcessExecutor(EngineClient):
    """Engine loop in a background thread; owned by the server, stopped by :meth:`shutdown`."""

    def __init__(self, engine: LLMEngine, role: WorkerRole | None = None, shards: RankShards | None = None) -> None:
        self._engine = engine
        self._role = role or WorkerRole()
        self._shards = shards or RankShards([engine.kv_cache], [])
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._requests = StreamRegistry(EngineState.STARTING)
        self._stop = threading.Event()
        self._stats = self._read_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the role and the engine loop thread, then open the admission gate."""
        self._role.start(self._engine, self, self._shards)
        self._thread.start()
        self._requests.transition(EngineState.STARTING, EngineState.SERVING)

    def drain(self) -> None:
        self._requests.transition(EngineState.SERVING, EngineState.DRAINING)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)  # wake the loop
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.1f s", timeout_s)
        await asyncio.to_thread(self._role.stop)
        self._die("the server is shutting down", log_error=False)

    # ---- properties -----------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._requests.state

    @property
    def dead_reason(self) -> str | None:
        return self._requests.dead_reason

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def stats(self) -> dict:
        return {**self._stats, **self._role.stats()}

    async def fresh_stats(self) -> dict:
        return self.stats()

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest,
                       disagg: DisaggregatedParams | None = None) -> AsyncIterator[object]:
        stream = self._requests.register(request.request_id)
        self._commands.put(lambda: self._add(request, disagg, stream))
        async for item in self._requests.consume(request.request_id, stream, self.abort):
            yield item

    def _add(self, request: EngineRequest, disagg: DisaggregatedParams | None, stream: RequestStream) -> None:
        try:
            self._role.on_submit(request, disagg)
            self._engine.add_request(request)
        except ValueError as err:  # RequestValidationError and friends: this request only
            stream.put(err)

    def abort(self, request_id: str) -> None:
        def _abort() -> None:
            if not self._role.intercept_abort(request_id):
                self._engine.abort_request(request_id)

        self._commands.put(_abort)

    async def release_lease(self, ctx_request_id: str) -> bool:
        return self._role.release(ctx_request_id)

    # ---- WorkerOps (for the role; thread-safe) ------------------------------------------------
    def post(self, fn: Callable[[LLMEngine], None]) -> None:
        self._commands.put(lambda: fn(self._engine))

    def deliver(self, request_id: str, item: object) -> None:
        stream = self._requests.get(request_id)
        if stream is not None:
            stream.put(item)

    # ---- engine loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self._engine.has_work())
                if self._stop.is_set():
                    break
                if self._engine.has_work():
                    result = self._engine.step()
                    for pull in result.kv_pulls:
                        self._role.on_pull(pull)
                    for out in result.outputs:
                        self._role.on_output(out)
                        self.deliver(out.request_id, out)
                self._stats = self._read_stats()
        except Exception as err:  # noqa: BLE001 - any engine failure makes the engine dead for good
            log.exception("engine loop failed")
            self._die(f"engine loop failed: {type(err).__name__}: {err}")

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _read_stats(self) -> dict[str, int]:
        return self._engine.stats()

    def _die(self, reason: str, log_error: bool = True) -> None:
        """Make the engine dead (sticky) and fail every pending request with EngineDeadError."""
        self._requests.die(reason, log_error)
