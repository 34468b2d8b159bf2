"""The server's Prometheus metrics (`/metrics`), in a registry of its own per Server so two servers
in one process (tests) never share or collide on metrics.

Counters the transport bumps by name (`Server.counters`, written by the server and its
connections) are exported as `edgeinfer_<name>_total`, errors as `edgeinfer_errors_total{code}`;
connection and request gauges and the engine's numeric stats (`edgeinfer_engine_<stat>`) are read
at scrape time; the latency histograms are fed from each finished request's usage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgeinfer.core.events import Usage

# Prometheus' classic text format (what the metrics scrapers of every version read).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


class _LiveCollector(Collector):
    """Reads the server's counters, gauges and engine stats at each scrape."""

    def __init__(self, counters: Counter[str], gauges: Callable[[], Mapping[str, float]],
                 engine_stats: Callable[[], Mapping[str, Any]]) -> None:
        self._counters = counters
        self._gauges = gauges
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self._gauges().items()):
            yield GaugeMetricFamily(f"edgeinfer_{name}", f"edgeinfer {name.replace('_', ' ')}", value=value)
        for name in sorted(k for k in self._counters if not k.startswith("error:")):
            yield CounterMetricFamily(f"edgeinfer_{name}", f"edgeinfer {name.replace('_', ' ')}",
                                      value=self._counters[name])
        errors = CounterMetricFamily("edgeinfer_errors", "requests and frames answered with an error, by code",
                                     labels=["code"])
        for key in sorted(k for k in self._counters if k.startswith("error:")):
            errors.add_metric([key[6:]], self._counters[key])
        yield errors
        for name, value in sorted(self._engine_stats().items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"edgeinfer_engine_{name}", f"engine stat {name}", value=value)


class ServerMetrics:
    def __init__(self, counters: Counter[str], gauges: Callable[[], Mapping[str, float]],
                 engine_stats: Callable[[], Mapping[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LiveCollector(counters, gauges, engine_stats))
        self._ttft = Histogram("edgeinfer_time_to_first_token_seconds", "arrival to first token",
                               buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._tpot = Histogram("edgeinfer_time_per_output_token_seconds",
                               "mean time per output token after the first", buckets=_TPOT_BUCKETS_S,
                               registry=self.registry)
        self._queue = Histogram("edgeinfer_queue_time_seconds", "arrival to first scheduled",
                                buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._e2e = Histogram("edgeinfer_e2e_request_latency_seconds", "arrival to finish",
                              buckets=_LATENCY_BUCKETS_S, registry=self.registry)

    def observe(self, usage: Usage) -> None:
        """One finished request. Requests that produced no token have no TTFT/TPOT to report."""
        self._queue.observe(usage.queue_time_s)
        self._e2e.observe(usage.total_time_s)
        if usage.completion_tokens:
            self._ttft.observe(usage.ttft_s)
        if usage.completion_tokens > 1:
            self._tpot.observe(usage.tpot_s)

    def text(self) -> bytes:
        return generate_latest(self.registry)
