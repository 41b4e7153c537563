"""kvgate's Grafana dashboard: the committed JSON is what helm/grafana_dashboard.py writes, every panel has queries
and a unit, every query is PromQL that Prometheus parses and reads only series kvgate exports, and the chart's
ConfigMap carries the committed file for Grafana's sidecar.

Whether each query returns data from live kvgate processes is the real-Prometheus test's job; these run in
milliseconds."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helm.chart import FULLNAME, NAMESPACE, find, manifests, with_registry
from tests.observability.observability import (
    DASHBOARD, GENERATOR, dashboard_targets, exported_metric_names, metric_names, promtool,
)

# What Grafana substitutes before a query reaches Prometheus, as a user who picked every model would see it.
VARIABLES = {"$__rate_interval": "1m", "$model": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def run_generator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=60)


def test_the_committed_json_is_what_the_generator_writes() -> None:
    done = run_generator("--check")
    assert done.returncode == 0, f"{done.stderr}(run `python helm/grafana_dashboard.py` and commit the JSON)"
    assert "is current" in done.stdout


def test_check_fails_on_an_edited_json_and_says_how_to_fix_it(tmp_path: Path) -> None:
    edited = tmp_path / "grafana-dashboard.json"
    edited.write_text(DASHBOARD.read_text().replace('"title": "kvgate"', '"title": "edited by hand"'))

    done = run_generator("--check", "--out", str(edited))

    assert done.returncode == 1
    assert "python helm/grafana_dashboard.py" in done.stderr
    assert run_generator("--check", "--out", str(tmp_path / "missing.json")).returncode == 1


def test_the_generator_writes_the_file_it_checks(tmp_path: Path) -> None:
    out = tmp_path / "dashboard.json"
    assert run_generator("--out", str(out)).returncode == 0
    assert out.read_text() == DASHBOARD.read_text()


def test_every_panel_has_a_unit_and_queries_with_an_expression_and_a_ref_id() -> None:
    panels = [panel for panel in dashboard()["panels"] if panel["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_the_dashboard_has_the_panels_an_operator_asked_for() -> None:
    titles = {panel["title"] for panel in dashboard()["panels"]}
    for wanted in ("Requests by outcome", "Error ratio", "Refused by the gateway", "Time to first token (streamed)",
                   "Inter-token latency", "End-to-end latency", "Prefix-hit rate: predicted vs realised",
                   "Tokens per second by kind", "Tokens per second by adapter", "Replicas: desired vs ready",
                   "Queue depth and requests in flight", "Node cost per hour by pool", "Engine KV cache usage"):
        assert wanted in titles


def test_a_datasource_and_a_model_variable_and_no_fixed_rate_windows() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["query"]["query"] == "label_values(kvgate_router_in_flight, model)"
    assert variables["model"]["includeAll"] and variables["model"]["multi"]
    for panel, target in dashboard_targets(dashboard()):
        assert not re.search(r"\[\d+[smhd]\]", target["expr"]), f"{panel['title']}: use $__rate_interval"
        if "rate(" in target["expr"]:
            assert "[$__rate_interval]" in target["expr"], panel["title"]


def test_every_query_is_promql_that_prometheus_parses(tmp_path: Path) -> None:
    # promtool has no offline "parse this expression"; a rules file of one recording rule per query does it.
    records = []
    for i, (panel, target) in enumerate(dashboard_targets(dashboard())):
        expr = target["expr"]
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{panel['title']}: an unknown variable in {expr}"
        records.append({"record": f"dashboard:query_{i}", "expr": expr})
    rules_file = tmp_path / "dashboard-queries.rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))

    done = subprocess.run([promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stdout + done.stderr


def test_the_queries_read_only_series_kvgate_exports() -> None:
    exported = exported_metric_names()
    for panel, target in dashboard_targets(dashboard()):
        used = metric_names(target["expr"])
        assert used <= exported, f"{panel['title']} reads {sorted(used - exported)}, which nothing exports"


def test_the_charts_configmap_carries_the_committed_json_for_the_grafana_sidecar() -> None:
    objects = manifests(with_registry({"grafanaDashboard": {"enabled": True}}))
    config_map = find(objects, "ConfigMap", f"{FULLNAME}-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["data"] == {"kvgate.json": DASHBOARD.read_text()}


def test_the_sidecars_label_annotations_and_namespace_are_configurable() -> None:
    # Helm merges a map value into the default map: null drops the default label (`--set labels.grafana_dashboard=null`).
    values = {"grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": None, "dashboards": "kvgate"},
                                   "annotations": {"grafana_folder": "Inference"}, "namespace": "monitoring"}}
    config_map = find(manifests(with_registry(values)), "ConfigMap", f"{FULLNAME}-grafana-dashboard")
    assert config_map["metadata"]["labels"]["dashboards"] == "kvgate"
    assert "grafana_dashboard" not in config_map["metadata"]["labels"]
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Inference"}
    assert config_map["metadata"]["namespace"] == "monitoring"


def test_the_dashboard_configmap_is_off_by_default() -> None:
    names = [o["metadata"]["name"] for o in manifests(with_registry({})) if o["kind"] == "ConfigMap"]
    assert f"{FULLNAME}-grafana-dashboard" not in names


def test_the_generator_runs_without_kvgate_installed(tmp_path: Path) -> None:
    """It is a plain script beside the chart: the standard library only, so a chart maintainer needs no venv."""
    copy = tmp_path / "grafana_dashboard.py"
    shutil.copyfile(GENERATOR, copy)
    done = subprocess.run([sys.executable, "-I", "-S", str(copy), "--out", str(tmp_path / "d.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "d.json").read_text() == DASHBOARD.read_text()
