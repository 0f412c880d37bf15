"""When a server process stops, and with which exit status.

Three ways out, watched by :class:`ServerLifecycle` from the HTTP server's main loop:

- **Dead engine → exit 75.** A server whose engine is dead for good (a rank died, a step hung) has
  already failed its pending requests; it answers 503 for ``engine.dead_exit_grace_s`` (so error
  bodies and SSE error events reach their clients and the orchestrator's poll sees the 503), then
  exits with :data:`EXIT_ENGINE_DEAD` = 75 (``EX_TEMPFAIL`` of sysexits.h: "try again"). The local
  launcher restarts it (``max_restarts``), ``slurm/pdserve.sbatch`` restarts its step, and any
  other supervisor (systemd, Kubernetes) sees a plain non-zero exit. Only frontend 0 (the
  server's main process) does this; attached frontends stop with it.
- **SIGTERM → drain, then exit 0** (what Kubernetes expects before its SIGKILL): the engine stops
  admitting (every frontend answers new requests and ``/health`` with 503), then frontend 0 asks
  the orchestrator it registered with how to drain (``advisor``, :mod:`executor.drain_advice`). On
  ``move_kv`` (a gen server with another gen server ready) the engine moves every movable stream
  at its next decode step: its KV parked here under a lease, its stream ended with a ``moved``
  event that the orchestrator continues on another gen server, which pulls that KV. Whatever
  cannot move (``wait``, no orchestrator, a stream the orchestrator did not mark movable)
  finishes here; a movable n > 1 stream moves choice by choice (one lease each), or is handed
  back when a choice cannot be parked (its choices' KV freed; the orchestrator prefills each again). In-flight requests and parked KV leases (moved ones until their pull) get
  ``engine.drain_grace_s``; then uvicorn's graceful shutdown sends the last bytes. A second
  SIGTERM stops at once; SIGINT (Ctrl-C) keeps uvicorn's behaviour.
- **Normal shutdown** (the lifespan stops the engine): exit 0.

Exit statuses of ``python -m ctx_worker`` / ``gen_worker``: :mod:`pdserve.exit_codes` (0 stopped or
drained, 2 bad configuration, 3 the worker ranks failed during start-up, 75 the engine died).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn

from executor.drain_advice import DrainAdvice
from executor.engine_client import EngineClient, EngineState
from pdserve.exit_codes import EXIT_ENGINE_DEAD

log = logging.getLogger("pdserve.lifecycle")

POLL_S = 0.1             # how often the lifecycle looks at the engine state


@dataclass(frozen=True)
class ExitPolicy:
    """The lifecycle knobs of one server (``engine.*`` of its topology)."""

    dead_exit_grace_s: float = 0.25  # 503 this long after the engine died, then exit 75
    drain_grace_s: float = 25.0      # SIGTERM: in-flight work gets this long before the exit
    exit_when_dead: bool = True      # False in attached frontends: frontend 0 exits for the server

    @classmethod
    def of(cls, engine_settings, exit_when_dead: bool = True) -> "ExitPolicy":
        return cls(engine_settings.dead_exit_grace_s, engine_settings.drain_grace_s, exit_when_dead)


def open_work(stats: dict) -> int:
    """Requests the engine still holds: queued, running, pulling KV, or parked under a KV lease
    (the keys of ``engine.scheduler.Scheduler.counts`` and rank 0's ``running_requests``)."""
    held = sum(int(stats.get(k, 0)) for k in ("waiting_requests", "scheduled_requests", "pulling_requests",
                                               "parked_requests"))
    return max(held, int(stats.get("running_requests", 0)))


def drain_summary(stats: dict) -> str:
    """One log line's worth of what a drain left behind: requests moved (and the KV bytes their
    targets pulled from here), tokens this engine computed, free / total KV blocks."""
    sent = stats.get("kv_moved_sent") or {}
    return (f"moved {int(stats.get('requests_moved', 0))} request(s), {int(sent.get('bytes', 0))} KV bytes sent; "
            f"tokens computed {int(stats.get('tokens_computed', 0))}; "
            f"free blocks {stats.get('free_blocks', '?')} of {stats.get('total_blocks', '?')}")


Advisor = Callable[[], Awaitable[DrainAdvice]]


async def _no_orchestrator() -> DrainAdvice:
    return DrainAdvice("wait", "no orchestrator to ask (an attached frontend, or a server run alone)")


class ServerLifecycle:
    """Decides when the HTTP server stops and its exit status (see the module docstring).

    ``advisor``: how a SIGTERM drains (``move_kv`` or ``wait``), asked once per drain
    (frontend 0: :meth:`executor.drain_advice.DrainAdvisor.ask`; None: always wait).
    Owner: :class:`LifecycleServer` runs :meth:`watch` as a task of its main loop and cancels it
    when the loop ends. ``exit_code`` is read once uvicorn has returned.
    """

    def __init__(self, client: EngineClient, policy: ExitPolicy, clock=time.monotonic,
                 advisor: Advisor | None = None) -> None:
        self.client, self.policy, self._clock = client, policy, clock
        self._advisor = advisor or _no_orchestrator
        self.exit_code = 0
        self.drain_requested = False
        self.drain_mode: str | None = None  # how the SIGTERM drain went: "move_kv" or "wait"

    def request_drain(self) -> None:
        """Called from the SIGTERM handler (main thread, between bytecodes): only sets a flag."""
        self.drain_requested = True

    async def watch(self, server: uvicorn.Server) -> None:
        """Poll until a way out applies, then set ``server.should_exit``."""
        while not server.should_exit:
            if self.drain_requested:
                await self._drain()
                break
            if self.policy.exit_when_dead and self.client.state == EngineState.DEAD:
                await self._exit_dead()
                break
            await asyncio.sleep(POLL_S)
        server.should_exit = True

    async def _exit_dead(self) -> None:
        log.error("engine is dead (%s); answering 503 for %.1f s, then exiting with status %d so that the "
                  "launcher restarts this server", self.client.dead_reason, self.policy.dead_exit_grace_s,
                  EXIT_ENGINE_DEAD)
        await asyncio.sleep(self.policy.dead_exit_grace_s)
        self.exit_code = EXIT_ENGINE_DEAD

    async def _drain(self) -> None:
        """Stop admitting, ask how to drain (moving KV or waiting), then wait (bounded) until the
        engine holds no request and no lease."""
        t0 = self._clock()
        if self.client.state == EngineState.SERVING:
            self.client.drain()  # first: nothing new is admitted while the orchestrator is asked
        advice = await self._advisor()
        self.drain_mode = advice.mode
        if advice.mode == "move_kv" and self.client.state == EngineState.DRAINING:
            self.client.drain(move_kv=True)
            log.info("SIGTERM: draining by moving KV (%s); up to %.0f s for what cannot move", advice.reason,
                     self.policy.drain_grace_s)
        else:
            log.info("SIGTERM: draining by waiting (%s; no new requests; up to %.0f s for in-flight ones)",
                     advice.reason, self.policy.drain_grace_s)
        left, stats = -1, {}
        while self._clock() - t0 < self.policy.drain_grace_s:
            left, stats = await self._open_work()
            if left == 0:
                break
            await asyncio.sleep(POLL_S)
        if left == 0:
            log.info("drained (%s) in %.2f s: %s; exiting", self.drain_mode, self._clock() - t0, drain_summary(stats))
        else:
            log.warning("drain grace of %.0f s is over with %d request(s) or lease(s) open; exiting anyway",
                        self.policy.drain_grace_s, left)

    async def _open_work(self) -> tuple[int, dict]:
        """(requests and leases the engine holds, the stats that says so)."""
        if self.client.state == EngineState.DEAD:
            return 0, {}  # nothing can finish any more
        try:
            stats = await self.client.fresh_stats()
        except (TimeoutError, RuntimeError):  # a long step, or the engine died meanwhile
            stats = self.client.stats()
        return open_work(stats), stats


class LifecycleServer(uvicorn.Server):
    """uvicorn's server with :class:`ServerLifecycle` watching it and SIGTERM meaning "drain"."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after the graceful
        # shutdown and the process would die of it instead of exiting 0.
        if self.lifecycle.drain_requested or self.should_exit:
            log.warning("second SIGTERM: stopping now")
            self.should_exit = True
        else:
            self.lifecycle.request_drain()

    async def main_loop(self) -> None:
        watcher = asyncio.create_task(self.lifecycle.watch(self), name="server-lifecycle")
        try:
            await super().main_loop()
        finally:
            if self.lifecycle.client.kv_events is not None:
                self.lifecycle.client.kv_events.close()  # end GET /kv_events streams before the graceful shutdown waits
            watcher.cancel()
            try:
                await watcher
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - a broken watcher must not hide how the server ended
                log.exception("the server lifecycle watcher failed")
