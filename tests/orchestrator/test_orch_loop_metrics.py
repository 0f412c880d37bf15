"""The hot path's lock-free metrics write what prometheus_client writes for the same samples."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from orchestrator.loop_metrics import LoopCounter, LoopHistogram


def _exposition(histogram, counter) -> list[str]:
    r = CollectorRegistry()
    h = histogram("x_seconds", "doc", ["endpoint"], buckets=(0.001, 0.01, 1), registry=r)
    u = histogram("y_seconds", "doc2", buckets=(0.5, 2), registry=r)
    c = counter("z", "docz", ["a", "b"], registry=r)
    plain = counter("w", "docw", registry=r)
    h.labels("/v1").observe(0.001)  # on a bound: in that bucket
    h.labels(endpoint="/v1").observe(0.5)
    h.labels("/v2").observe(5)
    for _ in range(3):
        h.labels("/v2").observe(0.0)
    u.observe(1.0)
    c.labels(a="1", b="2").inc()
    c.labels("1", "2").inc(3)
    plain.inc(2)
    return [line for line in generate_latest(r).decode().splitlines() if "_created" not in line]


def test_same_exposition_as_prometheus_client() -> None:
    assert _exposition(LoopHistogram, LoopCounter) == _exposition(Histogram, Counter)


def test_observe_times_counts_each() -> None:
    h = LoopHistogram("g", "doc", buckets=(0.1, 1))
    h.observe(0.0, 4)
    h.observe(0.5)
    assert h._own is not None and h._own.counts == [4, 1, 0] and h._own.sum == 0.5


def test_bad_labels_and_negative_inc_are_refused() -> None:
    c = LoopCounter("c", "doc", ["pool"])
    with pytest.raises(ValueError):
        c.labels(kind="x")
    with pytest.raises(ValueError):
        c.labels("a", "b")
    with pytest.raises(ValueError):
        c.inc()  # labelled: labels() first
    with pytest.raises(ValueError):
        c.labels("ctx").inc(-1)
    with pytest.raises(ValueError):
        LoopHistogram("h", "doc", buckets=(1, 0.5))
