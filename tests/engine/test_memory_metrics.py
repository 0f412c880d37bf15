"""/metrics exports the KV cache bytes and (on CUDA) the device memory torch holds."""
from prometheus_client import CollectorRegistry, generate_latest

from executor.metrics import RoleStatsCollector


def _scrape(stats: dict) -> str:
    registry = CollectorRegistry()
    registry.register(RoleStatsCollector(lambda: stats))
    return generate_latest(registry).decode()


def test_memory_gauges_follow_the_stats():
    from prometheus_client.parser import text_string_to_metric_families

    text = _scrape({"kv_cache_bytes": 3 << 20, "device_memory_used_bytes": 7 << 30})
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["pdserve_kv_cache_bytes"] == 3 << 20
    assert values["pdserve_device_memory_used_bytes"] == 7 << 30


def test_cpu_engine_reports_kv_bytes_only(tiny_engine):
    stats = tiny_engine.memory_stats()
    assert stats == {"kv_cache_bytes": tiny_engine.kv_cache.numel() * tiny_engine.kv_cache.element_size()}
    assert "device_memory_used_bytes" not in _scrape(stats)
