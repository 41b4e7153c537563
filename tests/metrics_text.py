"""Reading a Prometheus exposition text in tests: each sample by its name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """(sample name, its labels) -> value, of an exposition text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(exported: Samples, name: str, **labels: str) -> float | None:
    """The sample `name` with exactly `labels`; None when there is none."""
    return exported.get((name, frozenset(labels.items())))
