"""Prometheus metrics of a deployment, named `vllm_lite:*`, served at `/metrics`.

Request-level figures (latencies, token counters) are observed by the client's output processing
as outputs arrive; engine-level figures (running / waiting requests, KV-cache usage, prefix-cache
counters) come from each engine core's latest `EngineStats` and are reported at scrape time.
Each `Metrics` has its own registry, so several clients in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_lite.protocol.messages import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "vllm_lite:"

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_REQUEST_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
)


# (EngineStats field, metric family, name, help) of every per-engine metric.
_ENGINE_METRICS = (
    ("num_running", GaugeMetricFamily, "num_requests_running", "Requests being computed by an engine core."),
    ("num_waiting", GaugeMetricFamily, "num_requests_waiting", "Requests queued in an engine core."),
    ("kv_cache_usage", GaugeMetricFamily, "kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1)."),
    (
        "prefix_cache_queries",
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "prefix_cache_hits",
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prompt tokens served from the prefix cache.",
    ),
    ("num_preemptions", CounterMetricFamily, "num_preemptions", "Requests preempted (KV cache full)."),
)


class _EngineStatsCollector(Collector):
    """Reports the latest stats of every engine core at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[int, EngineStats] = {}

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        for field, kind, name, doc in _ENGINE_METRICS:
            family = kind(PREFIX + name, doc, labels=labels)
            for engine, stats in sorted(self.stats.items()):
                family.add_metric([self.model_name, str(engine)], float(getattr(stats, field)))
            yield family


class Metrics:
    """The counters and histograms of one deployment."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engines = _EngineStatsCollector(model_name)
        self.registry.register(self._engines)
        labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return h.labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(**labels)
        self._success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two output tokens.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to end.", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited in an engine before it ran.",
            _REQUEST_BUCKETS,
        )

    def update_engine_stats(self, engine_index: int, stats: EngineStats) -> None:
        self._engines.stats[engine_index] = stats

    def observe_tokens(self, num_tokens: int, first: bool, since_last_s: float) -> None:
        """New output tokens of one request: `since_last_s` is the time since its previous
        tokens (or since its arrival, for the first ones)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if first:
            self.ttft.observe(since_last_s)
            num_tokens -= 1
            since_last_s = 0.0
        for _ in range(num_tokens):
            self.itl.observe(since_last_s / max(num_tokens, 1))

    def observe_finished(
        self, e2e_s: float, queue_time_s: float | None, num_prompt_tokens: int, finish_reason: str | None
    ) -> None:
        self.e2e.observe(e2e_s)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self._success.labels(finished_reason=finish_reason or "error", **self._labels).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
