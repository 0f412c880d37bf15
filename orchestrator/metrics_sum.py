"""One ``/metrics`` for several orchestrator processes: the sum of their text expositions.

With ``orchestrator.num_workers`` > 1 every process counts what it served in its own registry;
the owner scrapes the others (:mod:`orchestrator.owner`) and answers their sum, so a scrape of
any process shows the whole orchestrator. Rules, per series (metric name + label set):

* counters, histogram buckets / ``_sum`` / ``_count`` and per-process gauges (in-flight
  requests) are **summed** over the processes;
* gauges that describe the shared cluster view, not one process's work
  (:data:`VIEW_METRICS`: pool sizes, target sizes, the process count), are taken from the
  **first** exposition only, the owner's, whose view the others mirror;
* ``*_created`` series (a creation timestamp per series) are dropped: a sum of timestamps means
  nothing, and Prometheus does not need them.

The text format is Prometheus' exposition format 0.0.4, parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

VIEW_METRICS = frozenset({"pdserve_orchestrator_pool_servers", "pdserve_orchestrator_pool_target_instances",
                          "pdserve_orchestrator_processes"})


class _Families:
    """Merged families, in first-seen order; each maps (sample name, labels) -> value."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}  # family name -> (type, help)
        self.values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}

    def add(self, text: str, first: bool) -> None:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created") or (family.name in VIEW_METRICS and not first):
                continue
            self.meta.setdefault(family.name, (family.type, family.documentation))
            series = self.values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                series[key] = series.get(key, 0.0) + sample.value

    def collect(self) -> Iterator[Metric]:
        for name, (type_, doc) in self.meta.items():
            metric = Metric(name, doc, type_)
            for (sample_name, labels), value in self.values[name].items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric


def sum_expositions(texts: list[bytes]) -> bytes:
    """The sum of Prometheus text expositions (see the module docstring); ``texts[0]`` is the
    owner's. Raises ValueError when a text is not in the exposition format."""
    families = _Families()
    for i, text in enumerate(texts):
        families.add(text.decode("utf-8"), first=i == 0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(families)  # type: ignore[arg-type] - a collector is anything with collect()
    return generate_latest(registry)
