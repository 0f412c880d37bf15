"""Counters and a fixed-bucket histogram of KV transfers, kept next to the transceivers.

The transceivers run in the worker rank, the Prometheus registry in the HTTP frontends: the rank
keeps these plain numbers and ships them in its stats snapshot, and every frontend exports them
(``executor.metrics.RoleStatsCollector``) — so each frontend of a server shows the server's totals.
"""

from __future__ import annotations

import bisect
import threading

# Seconds; the same scale as the servers' latency histograms (a pull is ms to seconds).
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TransferStats:
    """Thread-safe: bytes, count and a duration histogram of one transfer direction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.count = 0
        self.seconds_sum = 0.0
        self.bucket_counts = [0] * (len(BUCKETS_S) + 1)  # last one is +Inf

    def observe(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.count += 1
            self.seconds_sum += seconds
            self.bucket_counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1

    def snapshot(self) -> dict:
        """JSON-able: ``bytes``, ``count``, ``seconds_sum``, cumulative ``buckets`` [(le, count), ...]."""
        with self._lock:
            cumulative, total = [], 0
            for le, n in zip([*BUCKETS_S, float("inf")], self.bucket_counts):
                total += n
                cumulative.append((le, total))
            return {"bytes": self.bytes, "count": self.count, "seconds_sum": self.seconds_sum, "buckets": cumulative}
