"""The replica's Prometheus metrics, `kvgate_engine_*`, in a registry owned by one app (no global).

Two sources:
- the engine's own counters and gauges, read from `AsyncLLM.stats` (an immutable snapshot the
  worker publishes after every step) at scrape time, so /metrics never touches the engine thread;
- what only the server sees, measured with the injected clock: time to first token (request
  arrival -> first token), time per output token (per request: (last - first token) / (tokens - 1)),
  and finished requests by reason.

The router scrapes these from foreign backends too, so names follow vLLM's where one exists, with
kvgate's prefix and base units (`_seconds`, `_total`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.engine.core import EngineStats
from kvgate.exposition import exposition

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds. A tiny model on a CPU answers in a millisecond; a large prompt on a busy GPU in many seconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5)


class ServerMetrics:
    """Everything /metrics shows for one app. Observe from the event loop; `render` for a scrape."""

    def __init__(self, stats: Callable[[], EngineStats], draining: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.time_to_first_token = Histogram(
            "kvgate_engine_time_to_first_token_seconds", "Request arrival to its first generated token.",
            buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.time_per_output_token = Histogram(
            "kvgate_engine_time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first, one observation per request.",
            buckets=TPOT_BUCKETS_S, registry=self.registry)
        self.requests_finished = Counter(
            "kvgate_engine_requests_finished", "Requests that ended, by finish reason (stop, length, abort).",
            ["finish_reason"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(stats, draining))

    def observe_request(self, *, arrival_s: float, first_token_s: float | None, last_token_s: float | None,
                        num_output_tokens: int, finish_reason: str) -> None:
        """Record one request that ended. Times are readings of the server's injected clock."""
        if first_token_s is not None:
            self.time_to_first_token.observe(first_token_s - arrival_s)
            if last_token_s is not None and num_output_tokens > 1:
                self.time_per_output_token.observe((last_token_s - first_token_s) / (num_output_tokens - 1))
        self.requests_finished.labels(finish_reason=finish_reason).inc()

    def render(self) -> bytes:
        return exposition(self.registry)


class _EngineStatsCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], draining: Callable[[], bool]) -> None:
        self._stats = stats
        self._draining = draining

    def describe(self) -> list[Metric]:
        return []  # read at scrape time only: no registration-time collect

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("kvgate_engine_requests_waiting", "Requests queued, not yet scheduled.",
                                value=s.num_waiting)
        yield GaugeMetricFamily("kvgate_engine_requests_running", "Requests holding KV blocks.",
                                value=s.num_running)
        yield GaugeMetricFamily("kvgate_engine_kv_blocks_free", "Free KV blocks, counting reclaimable cached ones.",
                                value=s.num_kv_blocks_free)
        yield GaugeMetricFamily("kvgate_engine_kv_blocks_total", "KV blocks in the pool.",
                                value=s.num_kv_blocks_total)
        yield GaugeMetricFamily("kvgate_engine_kv_block_size_tokens", "Tokens per KV block.",
                                value=s.block_size_tokens)
        yield CounterMetricFamily("kvgate_engine_prefix_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_queried_tokens_total)
        yield CounterMetricFamily("kvgate_engine_prefix_hit_tokens", "Prompt tokens found in the prefix cache.",
                                  value=s.prefix_hit_tokens_total)
        yield CounterMetricFamily("kvgate_engine_preemptions", "Requests preempted for lack of KV blocks.",
                                  value=s.num_preemptions_total)
        yield CounterMetricFamily("kvgate_engine_prefix_waits", "Admissions put off a step because another "
                                  "request was computing the KV blocks of the same prefix.",
                                  value=s.num_prefix_waits_total)
        yield CounterMetricFamily("kvgate_engine_generated_tokens", "Tokens generated.",
                                  value=s.num_generated_tokens_total)
        yield CounterMetricFamily("kvgate_engine_prompt_tokens", "Prompt tokens admitted.",
                                  value=s.num_prompt_tokens_total)
        yield CounterMetricFamily("kvgate_engine_requests_aborted", "Requests cancelled before they finished "
                                  "(client gone, drain timeout).", value=s.num_requests_aborted_total)
        yield GaugeMetricFamily("kvgate_engine_adapters_loaded", "LoRA adapters resident in memory.",
                                value=len(s.adapters_loaded))
        yield CounterMetricFamily("kvgate_engine_adapter_loads", "LoRA adapter loads into memory.",
                                  value=s.num_adapter_loads_total)
        yield CounterMetricFamily("kvgate_engine_adapter_evictions", "LoRA adapters evicted.",
                                  value=s.num_adapter_evictions_total)
        yield GaugeMetricFamily("kvgate_engine_draining", "1 while the server drains before exiting.",
                                value=float(self._draining()))
