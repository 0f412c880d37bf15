"""The step watchdog: a step past the timeout makes the engine dead once; normal steps never do."""

from __future__ import annotations

import threading
import time

import pytest

from executor.step_guard import STEP_DELAY_ENV, StepWatchdog, guard_engine, injected_delay_s


def test_a_hung_step_fires_once_between_timeout_and_one_and_a_quarter_timeouts():
    fired: list[tuple[float, str]] = []
    done = threading.Event()
    dog = StepWatchdog(0.4, lambda why: (fired.append((time.monotonic(), why)), done.set()))
    dog.start()
    release = threading.Event()
    step = dog.wrap(lambda: release.wait(5))
    t0 = time.monotonic()
    worker = threading.Thread(target=step)
    worker.start()
    try:
        assert done.wait(3), "the watchdog never fired"
        elapsed = fired[0][0] - t0
        assert 0.4 <= elapsed < 0.4 * 1.25 + 0.3, elapsed  # +0.3 s: a loaded machine wakes threads late
        assert "step 1 ran past engine.step_timeout_s=0.4 s" in fired[0][1]
    finally:
        release.set()
        worker.join(5)
        dog.stop()
    assert len(fired) == 1 and dog.fired


def test_steps_under_the_timeout_never_fire():
    fired = []
    dog = StepWatchdog(0.3, fired.append)
    dog.start()
    step = dog.wrap(lambda x: x + 1)
    deadline = time.monotonic() + 1.0
    n = 0
    while time.monotonic() < deadline:  # many short steps over three timeouts' worth of time
        assert step(n) == n + 1
        n += 1
        time.sleep(0.01)
    dog.stop()
    assert fired == [] and not dog.fired and dog.overdue_s() < 0


def test_an_exception_in_the_step_ends_the_step():
    dog = StepWatchdog(0.2, lambda why: None)
    step = dog.wrap(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        step()
    assert dog.overdue_s() == -0.2  # no step in progress


def test_guard_engine_wraps_step_and_applies_the_injected_delay(monkeypatch):
    class Engine:
        def step(self):
            return "result"

    monkeypatch.setenv(STEP_DELAY_ENV, "0.2")
    engine = Engine()
    dog = guard_engine(engine, 30.0, lambda why: None)
    try:
        t0 = time.monotonic()
        assert engine.step() == "result"
        assert time.monotonic() - t0 >= 0.2
    finally:
        dog.stop()


def test_timeout_must_be_positive_and_delay_must_parse(monkeypatch):
    with pytest.raises(ValueError):
        StepWatchdog(0, lambda why: None)
    monkeypatch.setenv(STEP_DELAY_ENV, "soon")
    with pytest.raises(ValueError):
        injected_delay_s()
    monkeypatch.delenv(STEP_DELAY_ENV)
    assert injected_delay_s() == 0.0
