"""Prometheus metrics of the parallel prefill group, read from the engine at every scrape.

Read at scrape time rather than after each step: a worker that dies, and the group's restart, happen
while the engine may be idle, and ``/metrics`` should show them then. ``read`` returns the supervisor's
``GroupState`` (``kvserve/parallel/supervisor.py``; not imported here, which would load torch.distributed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.server.metric_prefix import PREFIX


class PrefillGroupCollector:
    """Gauges ``prefill_parallel_up``, ``prefill_parallel_workers``, ``prefill_parallel_workers_alive``;
    counters ``prefill_parallel_restarts_total``, ``prefill_parallel_failures_total``."""

    def __init__(self, read: Callable[[], object], model_name: str) -> None:
        self.read = read
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        state = self.read()
        values = (
            (GaugeMetricFamily, "prefill_parallel_up", float(state.state == "up"),
             "1 while long prompts prefill over the worker processes; 0 while the group restarts or is off "
             "(prompts then prefill in the server's own process)"),
            (GaugeMetricFamily, "prefill_parallel_workers", state.workers, "Worker processes the prefill group has."),
            (GaugeMetricFamily, "prefill_parallel_workers_alive", state.workers_alive,
             "Worker processes of the running prefill group alive now (0 while it restarts)."),
            (CounterMetricFamily, "prefill_parallel_restarts", state.restarts,
             "Prefill groups started again after a worker died, hung or failed."),
            (CounterMetricFamily, "prefill_parallel_failures", state.failures,
             "Prefill groups lost (a worker died, hung or failed) and restarts that did not come up."),
        )  # fmt: skip
        for family, name, value, doc in values:
            metric = family(PREFIX + name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
