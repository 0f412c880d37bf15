"""Counters and histograms for the orchestrator's hot path: plain Python numbers, no locks.

Why not ``prometheus_client.Counter``/``Histogram`` there: each of their updates takes a mutex
(a histogram two: its sum and its bucket) and checks the metric is observable, and ``labels()``
validates and locks on every call. A streamed request records ~20 samples (one inter-token gap
per chunk relayed); in a py-spy profile under ``bench/orchestrator_overhead.py``'s wrk load that
was ~6% of the orchestrator's CPU. Every sample here is recorded on the event loop thread (the
relay, the routes) and read there too (``GET /metrics`` is an async route), so plain integer and
float updates are safe; the GIL keeps a scrape from a thread consistent per series anyway
(:meth:`LoopHistogram.collect` copies a child's buckets in one step).

The exposition is what ``prometheus_client`` writes for the same metric (same names, ``_total`` on
counters, cumulative ``le`` buckets, ``_count``, ``_sum``), less the ``*_created`` series (which
:mod:`orchestrator.metrics_sum` drops anyway). Register a metric with
``registry=`` (as ``prometheus_client``'s metrics take it); each is a ``prometheus_client`` collector.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class _LabelSet:
    """Children by label values (positional or keyword, as ``prometheus_client``'s ``labels()``)."""

    def __init__(self, name: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], object] = {}

    def key(self, args: tuple, kwargs: dict) -> tuple[str, ...]:
        if kwargs:
            if args or set(kwargs) != set(self.labelnames):
                raise ValueError(f"{self.name}: labels must be {self.labelnames}, got {args or tuple(kwargs)}")
            return tuple(str(kwargs[n]) for n in self.labelnames)
        if len(args) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values needed, got {len(args)}")
        return tuple(str(a) for a in args)

    def child(self, args: tuple, kwargs: dict, make: Callable[[], object]) -> object:
        """The child of these label values, made by ``make()`` on first use. Raises ValueError on
        wrong labels."""
        child = self.children.get(args) if not kwargs else None  # the usual call: label values as str
        if child is None:
            key = self.key(args, kwargs)
            child = self.children.get(key)
            if child is None:
                child = self.children[key] = make()
        return child


class CounterChild:
    """One series of a :class:`LoopCounter`; ``value`` is its total."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0). Raises ValueError on a negative amount."""
        if amount < 0:
            raise ValueError(f"counters only go up (inc by {amount})")
        self.value += amount


class LoopCounter:
    """A counter (``name`` without ``_total``; ``labelnames`` may be empty: then ``inc`` directly)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self._doc = documentation
        self._labels = _LabelSet(name, labelnames)
        self._own = CounterChild() if not labelnames else None
        if registry is not None:
            registry.register(self)

    def labels(self, *args: str, **kwargs: str) -> CounterChild:
        """The series of these label values (created at 0 on first use). Raises ValueError on wrong labels."""
        return self._labels.child(args, kwargs, CounterChild)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        """Add to an unlabelled counter. Raises ValueError when it has labels."""
        if self._own is None:
            raise ValueError(f"{self._labels.name} has labels {self._labels.labelnames}: use labels()")
        self._own.inc(amount)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._labels.name, self._doc, labels=self._labels.labelnames)
        if self._own is not None:
            family.add_metric((), self._own.value)
        for key, child in list(self._labels.children.items()):
            family.add_metric(key, child.value)  # type: ignore[attr-defined]
        yield family


class HistogramChild:
    """One series of a :class:`LoopHistogram`: per-bucket counts (not cumulative; the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Record ``value`` (seconds, or the metric's unit) ``times`` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times


class LoopHistogram:
    """A histogram with ``buckets`` (upper bounds, ascending; +Inf is added) and optional labels."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = (), registry: CollectorRegistry | None = None) -> None:
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be ascending and distinct, got {buckets}")
        self._doc = documentation
        self._bounds = bounds
        self._labels = _LabelSet(name, labelnames)
        self._own = HistogramChild(bounds) if not labelnames else None
        if registry is not None:
            registry.register(self)

    def labels(self, *args: str, **kwargs: str) -> HistogramChild:
        """The series of these label values (empty on first use). Raises ValueError on wrong labels."""
        return self._labels.child(args, kwargs, lambda: HistogramChild(self._bounds))  # type: ignore[return-value]

    def observe(self, value: float, times: int = 1) -> None:
        """Record into an unlabelled histogram. Raises ValueError when it has labels."""
        if self._own is None:
            raise ValueError(f"{self._labels.name} has labels {self._labels.labelnames}: use labels()")
        self._own.observe(value, times)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._labels.name, self._doc, labels=self._labels.labelnames)
        series = [((), self._own)] if self._own is not None else list(self._labels.children.items())
        for key, child in series:
            counts, total = list(child.counts), child.sum  # type: ignore[attr-defined]
            cumulative, buckets = 0, []
            for bound, n in zip((*self._bounds, math.inf), counts):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(key, buckets, total)
        yield family
