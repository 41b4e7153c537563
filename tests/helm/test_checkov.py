"""checkov's Kubernetes policies over the chart as Helm renders it, for the value sets that turn the most
on. checkov's own `--framework helm` shells out to a `helm` binary, which this machine cannot have, so
it scans the rendered manifests (`--framework kubernetes`), which is what a cluster would receive.

The scan must pass; the only findings left open are the ones a template annotates in place with
`checkov.io/skipN: CHECK=reason`, listed here with the objects that carry them, so a new finding or a
skip without a reason fails the test. Engine Deployments are not in the scan: the autoscaler creates
them at run time (their pod template's security settings are checked in test_render.py and test_kmock.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helm.chart import FULLNAME, NAMESPACE, VALUE_SETS, render, with_registry
from tests.services import checkov_command

SCANNED = ("defaults", "ingress-and-httproute", "gpu-engines", "external-redis", "usage-log", "usage-log-on-a-claim",
           "observability")
SHARED_SKIPS = {"CKV_K8S_11", "CKV_K8S_15", "CKV_K8S_43"}  # no CPU limit, IfNotPresent, tags (reasons in place)
EXPECTED_SKIPS = {
    f"Deployment.{NAMESPACE}.{FULLNAME}-gateway": SHARED_SKIPS | {"CKV_K8S_35"},
    f"Deployment.{NAMESPACE}.{FULLNAME}-autoscaler": SHARED_SKIPS | {"CKV_K8S_35", "CKV_K8S_38"},
    f"StatefulSet.{NAMESPACE}.{FULLNAME}-redis": SHARED_SKIPS | {"CKV_K8S_35"},
}


def scan(tmp_path: Path) -> dict:
    for value_set in SCANNED:
        folder = tmp_path / value_set
        folder.mkdir()
        for path, text in render(with_registry(VALUE_SETS[value_set])).items():
            if path.endswith(".yaml") and text.strip():
                (folder / Path(path).name).write_text(text)
    # --skip-download: checkov would otherwise try to fetch guidelines from its vendor's API.
    done = subprocess.run([*checkov_command(), "-d", str(tmp_path), "--framework", "kubernetes",
                           "--skip-download", "-o", "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


def test_checkov_passes_with_only_the_justified_skips(tmp_path: Path) -> None:
    report = scan(tmp_path)
    summary, results = report["summary"], report["results"]
    assert (summary["failed"], summary["parsing_errors"]) == (0, 0), results["failed_checks"]
    assert summary["passed"] > 100 and summary["resource_count"] > 20
    skipped: dict[tuple[str, str], set[str]] = {}
    for check in results["skipped_checks"]:
        value_set = Path(check["file_abs_path"]).parent.name
        assert check["check_result"]["suppress_comment"].strip(), f"{check['check_id']} on {check['resource']} has no reason"
        skipped.setdefault((value_set, check["resource"]), set()).add(check["check_id"])
    for value_set in SCANNED:
        found = {resource: ids for (where, resource), ids in skipped.items() if where == value_set}
        expected = {r: ids for r, ids in EXPECTED_SKIPS.items()
                    if "redis" not in r or value_set != "external-redis"}
        assert found == expected, value_set
