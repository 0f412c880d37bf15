"""pidfd monitor: a death is reported at once; a recycled pid is refused."""

import subprocess
import sys
import threading
import time

import pytest

from executor.monitor import RankMonitor, RankProcess, proc_start_time


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_death_is_reported_within_milliseconds():
    p = sleeper()
    died = threading.Event()
    seen = []
    mon = RankMonitor([RankProcess(0, p.pid, proc_start_time(p.pid))], lambda r, why: (seen.append((r, why)), died.set()))
    mon.start()
    t0 = time.monotonic()
    p.kill()
    assert died.wait(2.0)
    assert time.monotonic() - t0 < 0.5
    assert seen[0][0] == 0 and str(p.pid) in seen[0][1]
    p.wait()
    mon.stop()


def test_wrong_start_time_is_refused():
    p = sleeper()
    try:
        with pytest.raises(ProcessLookupError, match="reused"):
            RankMonitor([RankProcess(0, p.pid, proc_start_time(p.pid) + 1)], lambda r, why: None)
    finally:
        p.kill()
        p.wait()


def test_stop_without_death():
    p = sleeper()
    seen = []
    mon = RankMonitor([RankProcess(0, p.pid, proc_start_time(p.pid))], lambda r, why: seen.append((r, why)))
    mon.start()
    time.sleep(0.1)
    assert seen == []  # a live rank is no death
    mon.stop()
    assert not mon._thread.is_alive(), "stop() left the monitor thread running"
    assert mon._fds == {} and mon._wake_r is None, "stop() left file descriptors open"
    # A death after stop() is nobody's business any more: no callback.
    p.kill()
    p.wait()
    time.sleep(0.2)
    assert seen == []
