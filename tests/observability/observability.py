"""What the observability tests share: where the dashboard and the alert rules live, promtool, each dashboard
query, and the metric names kvgate's processes export."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client.core import Metric

from kvgate.autoscaler.metrics import Reading, families
from kvgate.engine.core import EngineStats
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.router.metrics import RouterMetrics
from kvgate.state.records import AutoscalerStatus

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "helm" / "grafana_dashboard.py"
DASHBOARD = REPO / "helm" / "kvgate" / "files" / "grafana-dashboard.json"
RULES = REPO / "helm" / "kvgate" / "files" / "alerts.rules.yaml"
RULE_TESTS = Path(__file__).resolve().parent / "alerts_test.yaml"

_METRIC_NAME = re.compile(r"\bkvgate_[a-z0-9_]+\b")


def promtool() -> str:
    """promtool (Debian's `prometheus` package; `make setup` installs it). A missing one fails the test that needs
    it, never skips it."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run `make setup` (apt-get install prometheus)", pytrace=False)
    return path


def dashboard_targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    """(panel, target) for every query of every panel; rows hold no queries."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            yield panel, target


def metric_names(expr: str) -> set[str]:
    """The kvgate_* series names a PromQL expression reads."""
    return set(_METRIC_NAME.findall(expr))


def _exported(metric_families: Iterable[Metric]) -> set[str]:
    names = set()
    for family in metric_families:
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
    return names


def exported_metric_names() -> set[str]:
    """Every series name a gateway (RouterMetrics), an engine (ServerMetrics) and an autoscaler (the leader's
    families) export, read from their own code, so a renamed metric fails the queries that still use the old name."""
    idle = EngineStats(num_waiting=0, num_running=0, num_kv_blocks_free=0, num_kv_blocks_total=0, block_size_tokens=16,
                       prefix_queried_tokens_total=0, prefix_hit_tokens_total=0, num_preemptions_total=0,
                       num_generated_tokens_total=0, num_prompt_tokens_total=0, num_requests_finished_total=0,
                       num_requests_aborted_total=0)
    engine = ServerMetrics(lambda: idle, lambda: False)
    leader = Reading(leader=True, store_up=True, last_tick_at=0.0, pools=("gpu",), status=AutoscalerStatus(updated_at=0.0))
    return (_exported(RouterMetrics().registry.collect()) | _exported(engine.registry.collect())
            | _exported(families(leader, now=0.0)))
