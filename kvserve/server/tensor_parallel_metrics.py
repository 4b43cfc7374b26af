"""Prometheus gauges of the tensor-parallel group, read from the engine at every scrape (a rank can be lost
while the engine is idle, and ``/metrics`` should say so then)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from kvserve.server.metric_prefix import PREFIX


class TensorParallelCollector:
    """Gauges ``tensor_parallel_up``, ``tensor_parallel_size``, ``tensor_parallel_workers_alive``. ``group`` is
    the engine's ``TensorParallelGroup`` (not imported here, which would load torch.distributed)."""

    def __init__(self, group: object, model_name: str) -> None:
        self.group = group
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        group = self.group
        values = (
            ("tensor_parallel_up", float(group.failure is None and not group.closed),
             "1 while every tensor-parallel rank serves; 0 once one is lost (the server then refuses requests)"),
            ("tensor_parallel_size", group.size, "Ranks each layer's heads and MLP are split over."),
            ("tensor_parallel_workers_alive", group.workers_alive,
             "Worker processes this machine started that are still alive."),
        )  # fmt: skip
        for name, value, doc in values:
            metric = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
