"""Prometheus metrics of one ctx/gen server (its own registry, served at ``/metrics``).

Names follow the conventions of existing serving stacks (``*_seconds`` histograms, ``*_total``
counters; TTFT/TPOT as in vLLM's ``vllm:time_to_first_token_seconds`` and
``vllm:time_per_output_token_seconds``), prefixed ``pdserve_``; queue time and the waiting/running gauges as vLLM's
``vllm:request_queue_time_seconds``, ``vllm:num_requests_waiting`` and ``vllm:num_requests_running``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.step_timing import LOOP_KINDS, STEP_KINDS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Every metric one server exports; ``role`` and ``kv_backend`` become constant labels."""

    def __init__(self, role: str, kv_backend: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_server_requests", "Finished requests by request_type and outcome",
                                ["request_type", "outcome"], registry=r)
        self.errors = Counter("pdserve_server_errors", "Errors by kind", ["kind"], registry=r)
        self.ttft = Histogram("pdserve_server_time_to_first_token_seconds", "Submit to first output token",
                              ["request_type"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_server_time_per_output_token_seconds", "Gap between output tokens (ITL)",
                              ["request_type"], buckets=_TPOT_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve_server_request_queue_time_seconds",
                                    "Arrival in the engine to first admission (KV blocks allocated)",
                                    ["request_type"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_server_e2e_request_latency_seconds", "Submit to last token",
                             ["request_type"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_server_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_server_generation_tokens", "Output tokens", registry=r)
        self.kv_free_blocks = Gauge("pdserve_kv_cache_free_blocks",
                                    "KV blocks no request references (cached evictable ones included)", registry=r)
        self.kv_total_blocks = Gauge("pdserve_kv_cache_total_blocks", "KV blocks in the cache", registry=r)
        self.requests_waiting = Gauge("pdserve_num_requests_waiting", "Requests queued in the engine (no blocks yet)",
                                      registry=r)
        self.requests_running = Gauge("pdserve_num_requests_running", "Requests the engine schedules every step",
                                      registry=r)
        self.info = Gauge("pdserve_server_info", "Constant 1, labelled with the server's role and KV backend",
                          ["role", "kv_backend"], registry=r)
        self.info.labels(role=role, kv_backend=kv_backend).set(1)
        self.role_stats: "RoleStatsCollector | None" = None  # the worker side's KV counters, when attached


class RoleStatsCollector:
    """Exports the worker side's KV counters (read from ``stats()`` at scrape time).

    The KV transceiver runs next to the engine, so its counters arrive as a stats snapshot rather
    than through this process's metric objects.
    """

    _COUNTERS = {
        "kv_pull_failures": ("pdserve_kv_transfer_pull_failures", "Failed KV pulls"),
        "kv_same_host_reads": ("pdserve_kv_transfer_same_host_reads",
                               "KV pulls whose bytes were read straight from a same-host ctx process (ucx)"),
        "kv_blocks_pulled": ("pdserve_kv_transfer_blocks_pulled", "KV blocks copied from ctx servers (gen)"),
        "kv_blocks_skipped": ("pdserve_kv_transfer_blocks_skipped",
                              "Prompt KV blocks a partial pull did not copy: this gen server's prefix cache held them"),
        "leases_expired": ("pdserve_kv_leases_expired", "Parked KV leases freed by their timer"),
        "leases_released": ("pdserve_kv_leases_released", "Parked KV leases released after a pull or a cancel"),
        "prefill_tokens": ("pdserve_prefill_tokens",
                           "Prompt tokens this server computed (neither from the prefix cache nor pulled); "
                           "a recompute after preemption counts again"),
        "prefix_cache_queries": ("pdserve_prefix_cache_queries",
                                 "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)"),
        "prefix_cache_hits": ("pdserve_prefix_cache_hits",
                              "Prompt tokens found in the prefix cache (vLLM's prefix_cache_hits)"),
        "kv_events_dropped_batches": ("pdserve_kv_events_dropped_batches",
                                      "KV event batches that fell off this frontend's buffer (a slow reader "
                                      "then gets a gap and resyncs)"),
    }

    def __init__(self, stats) -> None:
        self._stats = stats
        self.snapshot: dict | None = None  # a fresh snapshot set by the /metrics route for one scrape

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stats = self.snapshot if self.snapshot is not None else self._stats()
        transfers = stats.get("kv_transfer") or {}
        if transfers:
            nbytes = CounterMetricFamily("pdserve_kv_transfer_bytes", "KV bytes moved (sent: ctx, received: gen)",
                                         labels=["direction"])
            seconds = HistogramMetricFamily("pdserve_kv_transfer_seconds", "Duration of one KV transfer",
                                            labels=["direction"])
            for direction, snap in transfers.items():
                nbytes.add_metric([direction], snap["bytes"])
                buckets = [("+Inf" if le == float("inf") else repr(float(le)), n) for le, n in snap["buckets"]]
                seconds.add_metric([direction], buckets, snap["seconds_sum"])
            yield nbytes
            yield seconds
        for key, (name, doc) in self._COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])
        yield from _stage_counters(stats)
        if "cached_blocks" in stats:
            yield GaugeMetricFamily("pdserve_kv_cache_cached_blocks",
                                    "KV blocks held by the prefix cache (referenced or evictable)",
                                    value=stats["cached_blocks"])
        if "kv_cache_bytes" in stats:
            yield GaugeMetricFamily("pdserve_kv_cache_bytes", "Bytes of the KV cache (rank 0's)",
                                    value=stats["kv_cache_bytes"])
        if "device_memory_used_bytes" in stats:
            yield GaugeMetricFamily("pdserve_device_memory_used_bytes",
                                    "GPU memory torch holds in rank 0 (weights, KV cache, activations)",
                                    value=stats["device_memory_used_bytes"])
        if "parked_leases" in stats:
            yield GaugeMetricFamily("pdserve_kv_parked_leases", "Parked KV leases", value=stats["parked_leases"])


_STAGE_CLOCKS = {  # stats prefix (engine.step_timing.StageClock.snapshot) -> kinds, metric names and help
    "step": (STEP_KINDS, "pdserve_engine_steps", "Engine steps run, by kind (engine.step_timing.STEP_KINDS)",
             "pdserve_engine_step_stage_seconds",
             "Wall seconds of engine steps by kind and stage (engine.llm_engine.STEP_STAGES)"),
    "loop": (LOOP_KINDS, "pdserve_engine_loop_iterations",
             "Engine loop iterations, by the kind of step they ran (idle: none)",
             "pdserve_engine_loop_stage_seconds",
             "Wall seconds of engine loop iterations by kind and stage (executor.engine_loop.LOOP_STAGES)"),
}


def _stage_counters(stats: dict):
    """The step and loop stage clocks of a stats snapshot (``{prefix}_{kind}_count``,
    ``{prefix}_{kind}_{stage}_s``) as counters labelled ``kind`` (and ``stage``)."""
    from prometheus_client.core import CounterMetricFamily

    for prefix, (kinds, count_name, count_doc, seconds_name, seconds_doc) in _STAGE_CLOCKS.items():
        counts = CounterMetricFamily(count_name, count_doc, labels=["kind"])
        seconds = CounterMetricFamily(seconds_name, seconds_doc, labels=["kind", "stage"])
        for kind in kinds:
            head = f"{prefix}_{kind}_"
            if head + "count" not in stats:
                continue
            counts.add_metric([kind], stats[head + "count"])
            for key, value in stats.items():
                if key.startswith(head) and key.endswith("_s"):
                    seconds.add_metric([kind, key[len(head):-2]], value)
        if counts.samples:
            yield counts
            yield seconds
