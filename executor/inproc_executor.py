"""An :class:`EngineClient` that runs the engine loop in a thread of the server process.

Threads: the asyncio event loop (HTTP handlers) sends :mod:`executor.messages` commands through a
thread-safe queue (:class:`QueueTransport`); the ``engine-loop`` thread runs the same
:class:`executor.engine_loop.EngineLoop` as rank 0 of the lattice, so the same ordering rules hold,
and hands its events straight to :meth:`WorkerClient.dispatch` (each request's asyncio queue is
fed with ``call_soon_threadsafe``). A failure of the loop makes the engine dead for good (sticky):
every pending request gets :class:`EngineDeadError` at once and new submits are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from engine.llm_engine import LLMEngine
from executor.engine_client import EngineState
from executor.engine_loop import IDLE_WAIT_S, EngineLoop
from executor.kv_role import RankShards, WorkerRole
from executor.messages import Command, EngineDead, Event, Shutdown
from executor.worker_client import WorkerClient

log = logging.getLogger(__name__)


class QueueTransport:
    """The engine loop's transport inside one process: a command queue in, a callback out (one lane).

    ``submit`` and ``wake`` are thread-safe; ``on_event`` is called on the loop thread.
    """

    num_lanes = 1

    def __init__(self, on_event: Callable[[Event], None]) -> None:
        self._on_event = on_event
        self._queue: queue.Queue[Command | None] = queue.Queue()  # None: a wake-up

    def submit(self, cmd: Command) -> None:
        self._queue.put(cmd)

    def wake(self) -> None:
        self._queue.put(None)

    def receive(self, timeout_s: float) -> list[Command]:
        """Wait at most ``timeout_s`` for a command or wake-up; then take whatever else is queued."""
        try:
            first = self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        commands = [first] if first is not None else []
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return commands
            if cmd is not None:
                commands.append(cmd)

    def send(self, lane: int, events: list[Event]) -> None:
        for event in events:
            self._on_event(event)

    def report_dead(self, reason: str) -> None:
        self._on_event(EngineDead(reason))

    def stats(self) -> dict:
        return {}


class InProcessExecutor(WorkerClient):
    """Engine loop in a background thread; owned by the server, stopped by :meth:`shutdown`.

    ``idle_wait_s``: the loop's longest wait for a command while the engine cannot step (seconds).
    """

    def __init__(self, engine: LLMEngine, role: WorkerRole | None = None, shards: RankShards | None = None,
                 idle_wait_s: float = IDLE_WAIT_S) -> None:
        super().__init__(frontend_id=0, state=EngineState.STARTING)
        self._engine = engine
        self._role = role or WorkerRole()
        self._shards = shards or RankShards([engine.kv_cache], [])
        self._transport = QueueTransport(self.dispatch)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._loop: EngineLoop | None = None
        self._idle_wait_s = idle_wait_s
        self._stats = engine.stats()  # until the loop pushes its first snapshot

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the role and the engine loop thread, then open the admission gate."""
        self._loop = EngineLoop(self._engine, self._role, self._transport, self._shards, self._idle_wait_s)
        self._thread.start()
        self._requests.transition(EngineState.STARTING, EngineState.SERVING)

    def _run(self) -> None:
        try:
            self._loop.run_or_report("engine loop")
        finally:
            self._engine.close()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._send(Shutdown("the server is shutting down"))
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.1f s", timeout_s)
        self._die("the server is shutting down", log_error=False)

    def _send(self, cmd: Command) -> None:
        self._transport.submit(cmd)

    # ---- properties -----------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def engine(self) -> LLMEngine:
        return self._engine
