"""The step watchdog: an engine step that runs past ``engine.step_timeout_s`` makes the engine dead.

A step that hangs (a tensor-parallel collective that never returns, a wedged kernel) is invisible
to the pidfd monitor: the rank is alive, it just never comes back. :class:`StepWatchdog` wraps
``engine.step`` (so the engine loop itself is unchanged), records when the current step began,
and a thread it owns fires ``on_timeout(reason)`` once when a step has run longer than the
timeout. The timeout must exceed any legitimate step: the default (``engine.step_timeout_s``,
120 s) is far above a full-budget prefill on a CPU (a few seconds for 2,048 tokens of SmolLM2).

What ``on_timeout`` does depends on where the engine runs:
- rank 0 of the lattice (:func:`exit_rank`): tell every frontend the engine is dead (an
  ``EngineDead`` event on each result lane, so the reason names the timeout), then leave the process
  (``os._exit``): the pidfd monitors see it, ``mpiexec`` ends the other ranks, and a hung
  collective cannot linger;
- the in-process executor: make the client dead (the HTTP process then exits, see
  :mod:`executor.lifecycle`, and the hung thread goes with it).

Test hook: ``PDSERVE_TEST_STEP_DELAY_S`` (seconds, float) makes every engine step sleep that long
before it runs: a deliberately slow prefill, or, above the timeout, a hung step.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

STEP_DELAY_ENV = "PDSERVE_TEST_STEP_DELAY_S"
STEP_TIMEOUT_EXIT = 70   # rank 0's exit status after a step timeout (EX_SOFTWARE)
DEAD_NOTICE_S = 0.3      # rank 0 waits this long for its dead messages to reach the lanes


def injected_delay_s() -> float:
    """``PDSERVE_TEST_STEP_DELAY_S`` as seconds (0 when unset). Raises ValueError on a bad value."""
    raw = os.environ.get(STEP_DELAY_ENV, "")
    return float(raw) if raw else 0.0


class StepWatchdog:
    """Fires ``on_timeout(reason)`` once when one wrapped step runs longer than ``timeout_s``.

    Owner: whoever builds it calls :meth:`start` and :meth:`stop`. The check thread wakes every
    ``min(timeout_s / 4, 1 s)``, so a hang is reported between ``timeout_s`` and
    ``1.25 × timeout_s`` (at most ``timeout_s + 1 s``) after the step began.
    """

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None], *,
                 delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"step timeout must be > 0 s, got {timeout_s}")
        self.timeout_s, self.delay_s = timeout_s, delay_s
        self._on_timeout, self._clock = on_timeout, clock
        self._began: float | None = None   # monotonic start of the step in progress
        self._steps = 0
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def wrap(self, step: Callable) -> Callable:
        """``step`` with its start and end recorded (and the injected test delay, if any)."""
        @functools.wraps(step)
        def guarded(*args, **kwargs):
            self._began = self._clock()
            try:
                if self.delay_s > 0:
                    time.sleep(self.delay_s)
                return step(*args, **kwargs)
            finally:
                self._began = None
                self._steps += 1

        return guarded

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def overdue_s(self) -> float:
        """How far the step in progress is past the timeout (<= 0: none is)."""
        began = self._began
        return -self.timeout_s if began is None else self._clock() - began - self.timeout_s

    def _watch(self) -> None:
        period = min(self.timeout_s / 4, 1.0)
        while not self._stop.wait(period):
            if self.overdue_s() > 0:
                self.fired = True
                reason = (f"engine step {self._steps + 1} ran past engine.step_timeout_s={self.timeout_s:g} s "
                          "(hung step or collective)")
                log.error("%s", reason)
                self._on_timeout(reason)
                return


def guard_engine(engine, timeout_s: float, on_timeout: Callable[[str], None]) -> StepWatchdog:
    """Wrap ``engine.step`` with a started :class:`StepWatchdog`; the caller stops it."""
    watchdog = StepWatchdog(timeout_s, on_timeout, delay_s=injected_delay_s())
    engine.step = watchdog.wrap(engine.step)
    watchdog.start()
    return watchdog


def exit_rank(lane_addrs: list[str], codec) -> Callable[[str], None]:
    """Rank 0's ``on_timeout``: an ``EngineDead`` event on every frontend's lane, then ``os._exit``.

    It uses its own zmq context and sockets (the loop's sockets belong to the loop thread, which
    is the one that hangs).
    """
    def on_timeout(reason: str) -> None:
        import zmq

        from executor.messages import EngineDead

        zctx = zmq.Context()
        try:
            for addr in lane_addrs:
                sock = zctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, int(DEAD_NOTICE_S * 1000))
                sock.connect(addr)
                try:
                    sock.send(codec.encode([EngineDead(reason)]), zmq.NOBLOCK)
                except zmq.ZMQError as err:
                    log.warning("could not report the step timeout on %s: %s", addr, err)
                sock.close()
            time.sleep(DEAD_NOTICE_S)  # the frontends read the reason before the pidfds fire
        finally:
            logging.shutdown()
            os._exit(STEP_TIMEOUT_EXIT)

    return on_timeout
