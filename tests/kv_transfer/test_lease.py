"""Lease table: timer expiry on an idle table, release, pinned leases during a pull."""

import threading
import time

import pytest

from kv_transfer.lease import LeaseError, LeaseTable


class Freed:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.event = threading.Event()

    def __call__(self, rid: str, reason: str) -> None:
        self.calls.append((rid, reason))
        self.event.set()


@pytest.fixture
def table():
    freed = Freed()
    t = LeaseTable(freed)
    t.start()
    yield t, freed
    t.stop()


def test_unpulled_lease_expires_on_timer(table):
    t, freed = table
    t.park("a", [1, 2, 3], 40, ttl_s=0.2)
    t0 = time.monotonic()
    assert freed.event.wait(2.0), "lease never expired"
    assert 0.15 <= time.monotonic() - t0 < 1.5
    assert freed.calls == [("a", "expired")]
    assert len(t) == 0 and t.expired_total == 1


def test_release_frees_once(table):
    t, freed = table
    t.park("a", [1], 5, ttl_s=0.3)
    assert t.release("a") is True
    assert t.release("a") is False
    time.sleep(0.5)
    assert freed.calls == [("a", "released")]


def test_pinned_lease_is_not_expired_mid_pull(table):
    t, freed = table
    t.park("a", [1], 5, ttl_s=0.1)
    t.begin_pull("a")
    time.sleep(0.4)
    assert freed.calls == []  # still pinned
    t.end_pull("a")  # deadline passed meanwhile: freed now
    assert freed.calls == [("a", "expired")]


def test_release_during_pull_is_applied_after(table):
    t, freed = table
    t.park("a", [1], 5, ttl_s=10)
    t.begin_pull("a")
    assert t.release("a") is True
    assert freed.calls == []
    with pytest.raises(LeaseError):
        t.begin_pull("a")
    t.end_pull("a")
    assert freed.calls == [("a", "released")]


def test_unknown_lease(table):
    t, _ = table
    with pytest.raises(LeaseError, match="no KV lease"):
        t.begin_pull("nope")


def test_stop_frees_everything():
    freed = Freed()
    t = LeaseTable(freed)
    t.start()
    t.park("a", [1], 1, 60)
    t.park("b", [2], 1, 60)
    t.stop()
    assert sorted(freed.calls) == [("a", "shutdown"), ("b", "shutdown")]
