"""Prometheus text for the gateway's, the engine's and the autoscaler's /metrics: one registry each, without the
`_created` series.

prometheus_client adds a `_created` sample (when the child was made) to every counter and histogram child. It doubles
the series count, and no dashboard or alert here reads it. The library's own switch is process-wide state; this
filters one registry at exposition instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

__all__ = ["CONTENT_TYPE_LATEST", "WithoutCreated", "exposition", "render"]


class WithoutCreated:
    """`registry`'s metrics less their `_created` samples (an object generate_latest reads like a registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            if any(sample.name.endswith("_created") for sample in metric.samples):
                metric.samples = [sample for sample in metric.samples if not sample.name.endswith("_created")]
            yield metric


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format (0.0.4) of `registry`, without `_created` series; served as CONTENT_TYPE_LATEST."""
    return generate_latest(WithoutCreated(registry))  # type: ignore[arg-type]  # a registry in all but name


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """`exposition(registry)` and its content type, as a /metrics handler answers them."""
    return exposition(registry), CONTENT_TYPE_LATEST
