"""kvgate's alert rules, helm/kvgate/files/alerts.rules.yaml: promtool accepts them, its unit tests
(alerts_test.yaml) prove each alert fires where it should and stays quiet where it should not, every alert tells an
operator what to do, and the chart's PrometheusRule carries exactly this file's groups."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from tests.helm.chart import FULLNAME, find, manifests, with_registry
from tests.observability.observability import (
    REPO, RULE_TESTS, RULES, exported_metric_names, metric_names, promtool,
)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules_file() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_every_alert_passes_its_promtool_unit_tests() -> None:
    # promtool resolves the test file's rule_files from the test file's directory: run it from the repository
    # root all the same, as CI does.
    done = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_unit_tested_both_firing_and_quiet() -> None:
    checks = [check for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for check in test.get("alert_rule_test", ())]
    for rule in rules():
        mine = [check for check in checks if check["alertname"] == rule["alert"]]
        assert any(check["exp_alerts"] for check in mine), f"{rule['alert']}: no test where it fires"
        assert any(not check["exp_alerts"] for check in mine), f"{rule['alert']}: no test where it stays quiet"


def test_every_alert_says_what_happened_and_what_to_do() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))
    for rule in rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule.get("for"), f"{rule['alert']}: a `for` keeps one odd evaluation from paging"
        annotations = rule["annotations"]
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{rule['alert']}: no {key}"
        assert annotations["runbook_url"].endswith("/helm/kvgate/README.md#alerts")


def test_the_chart_readme_lists_every_alert() -> None:
    readme = (REPO / "helm" / "kvgate" / "README.md").read_text()
    assert "\n## Alerts\n" in readme  # the runbook_url anchor
    for rule in rules():
        assert f"`{rule['alert']}`" in readme, rule["alert"]


def test_the_alerts_read_only_series_kvgate_exports() -> None:
    exported = exported_metric_names()
    for rule in rules():
        used = metric_names(rule["expr"])
        assert used <= exported, f"{rule['alert']} reads {sorted(used - exported)}, which nothing exports"


@pytest.mark.parametrize("labels", [{}, {"release": "prometheus"}])
def test_the_charts_prometheus_rule_carries_the_rules_file(labels: dict[str, str]) -> None:
    objects = manifests(with_registry({"prometheusRule": {"enabled": True, "labels": labels},
                                       "gateway": {"serviceMonitor": {"enabled": True}}}))
    rule = find(objects, "PrometheusRule", f"{FULLNAME}-alerts")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == {"groups": yaml.safe_load(RULES.read_text())["groups"]}
    assert labels.items() <= rule["metadata"]["labels"].items()


def test_the_prometheus_rule_is_off_by_default() -> None:
    # Its CRD is prometheus-operator's: a cluster without it would refuse the whole install.
    assert not [o for o in manifests(with_registry({})) if o["kind"] == "PrometheusRule"]
