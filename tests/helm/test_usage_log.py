"""The gateway's usage log in the chart (`gateway.usageLog`; README "Usage accounting"). Off by default, and then
nothing of it renders. On, the gateway's root filesystem stays read-only and the log goes on a volume of its own
(an emptyDir, or a claim the user names), one file per pod, since N gateways must not share one file.

The rendered `--usage-log` is read by kvgate's own parser (test_cli_args.py parses every value set too, these
included), and the path it names, expanded as the kubelet expands `$(POD_NAME)`, is written by kvgate's own
UsageLog."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from kvgate.clock import FakeClock
from kvgate.router.usage_log import UsageLog
from tests.helm.chart import FULLNAME, VALUE_SETS, find, manifests, render, with_registry
from tests.helm.test_cli_args import parse_kvgate

DEFAULT_MOUNT_PATH = "/var/lib/kvgate/usage"


def gateway_pod(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, the gateway container) of the rendered gateway Deployment."""
    pod = find(manifests(with_registry(values)), "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


def kubelet_args(container: dict[str, Any], downward: dict[str, str]) -> list[str]:
    """The container's args as the kubelet passes them: `$(VAR)` becomes the value of the container's env VAR
    (here only `fieldRef` entries, resolved from `downward`: {"metadata.name": pod name}), `$$` becomes `$`,
    and a reference to a variable the container does not define stays as written."""
    env = {e["name"]: downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
           for e in container.get("env", ()) if "fieldRef" in e.get("valueFrom", {})}

    def expand(match: re.Match[str]) -> str:
        return "$" if match.group(0) == "$$" else env.get(match.group(1), match.group(0))
    return [re.sub(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)", expand, arg) for arg in container["args"]]


def test_off_by_default_the_gateway_renders_as_it_did_without_a_usage_log() -> None:
    off = {"gateway": {"usageLog": {"enabled": False, "existingClaim": "kvgate-usage", "mountPath": "/data/usage"}}}
    assert gateway_pod(off) == gateway_pod({})  # the other usageLog values change nothing while it is off
    pod, container = gateway_pod({})
    assert [v["name"] for v in pod["volumes"]] == ["registry", "tmp"]
    assert [m["name"] for m in container["volumeMounts"]] == ["registry", "tmp"]
    assert "--usage-log" not in container["args"] and parse_kvgate(container["args"]).usage_log is None
    assert "POD_NAME" not in [e["name"] for e in container["env"]]


@pytest.mark.parametrize("value_set,mount_path,volume", [
    ("usage-log", DEFAULT_MOUNT_PATH, {"emptyDir": {}}),
    ("usage-log-on-a-claim", "/data/usage", {"persistentVolumeClaim": {"claimName": "kvgate-usage"}}),
])
def test_on_the_gateway_logs_to_a_file_of_its_pod_on_a_writable_volume(
        value_set: str, mount_path: str, volume: dict[str, Any]) -> None:
    pod, container = gateway_pod(VALUE_SETS[value_set])
    assert parse_kvgate(container["args"]).usage_log == f"{mount_path}/usage-$(POD_NAME).jsonl"
    [pod_name] = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # the downward API
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "usage-log"]
    assert mount == {"name": "usage-log", "mountPath": mount_path}  # not readOnly
    [usage_volume] = [v for v in pod["volumes"] if v["name"] == "usage-log"]
    assert usage_volume == {"name": "usage-log", **volume}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True  # the volume is its one writable place
    [init] = pod["initContainers"]
    assert "usage-log" not in [m["name"] for m in init["volumeMounts"]]


def test_each_gateway_pod_appends_to_its_own_file_and_a_restarted_container_to_the_same(tmp_path: Path) -> None:
    """The rendered gateway container run as the kubelet would run it in two pods of the Deployment: its args
    expanded with each pod's name, the usage-log volume (a directory here) at its mountPath. kvgate's parser reads
    the path and kvgate's UsageLog writes there."""
    _, container = gateway_pod(VALUE_SETS["usage-log"])
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "usage-log"]
    volume = tmp_path / "usage-log"

    def run_gateway(pod_name: str, request_id: str) -> None:
        path = parse_kvgate(kubelet_args(container, {"metadata.name": pod_name})).usage_log
        assert path.startswith(f"{mount['mountPath']}/")  # on the volume, not the read-only root filesystem
        usage_log = UsageLog(volume / path.removeprefix(f"{mount['mountPath']}/"), FakeClock().now)
        usage_log.append({"request_id": request_id})
        usage_log.close()

    first, second = f"{FULLNAME}-gateway-7d9f8c6b5-x2k4p", f"{FULLNAME}-gateway-7d9f8c6b5-q8z7m"
    run_gateway(first, "a")
    run_gateway(second, "b")
    run_gateway(first, "c")  # the first pod's container restarted: same pod name, same file, appended to
    files = {p.name: [json.loads(line)["request_id"] for line in p.read_text().splitlines()] for p in volume.iterdir()}
    assert files == {f"usage-{first}.jsonl": ["a", "c"], f"usage-{second}.jsonl": ["b"]}


@pytest.mark.parametrize("usage_log,message", [
    ({"mountPath": "usage"}, "at '/gateway/usageLog/mountPath': 'usage' does not match pattern"),
    # The path is part of an argument, where the kubelet would expand a $(VAR) in it.
    ({"mountPath": "/var/$(HOME)"}, "at '/gateway/usageLog/mountPath': '/var/$(HOME)' does not match pattern"),
    ({"mountPath": "/var/lib/../usage"}, "at '/gateway/usageLog/mountPath': '/var/lib/../usage' does not match"),
    ({"existingClaim": "Usage_Claim"}, "at '/gateway/usageLog/existingClaim': 'Usage_Claim' does not match pattern"),
    ({"enabled": "yes"}, "at '/gateway/usageLog/enabled': got string, want boolean"),
    ({"path": "/data"}, "at '/gateway/usageLog': additional properties 'path' not allowed"),
])
def test_bad_usage_log_values_are_refused_naming_the_key(usage_log: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(with_registry({"gateway": {"usageLog": usage_log}}))
    assert message in str(caught.value)


@pytest.mark.parametrize("mount_path", ["/tmp", "/etc/kvgate/registry", "/etc/kvgate/registry/usage"])
def test_a_mount_path_on_a_volume_the_gateway_already_mounts_fails_the_render(mount_path: str) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(with_registry({"gateway": {"usageLog": {"enabled": True, "mountPath": mount_path}}}))
    assert f"gateway.usageLog.mountPath: {mount_path} is, or is inside, a volume the gateway already mounts" in str(
        caught.value)


def test_the_install_notes_say_where_the_usage_log_is_and_whether_it_outlives_the_pod() -> None:
    def notes(values: dict[str, Any]) -> str:
        return render(with_registry(values))["kvgate/templates/NOTES.txt"]

    assert "usage log" not in notes({})
    assert "on an emptyDir: it survives a container restart but is lost with the pod" in notes(VALUE_SETS["usage-log"])
    on_a_claim = notes(VALUE_SETS["usage-log-on-a-claim"])
    assert "/data/usage/usage-<pod name>.jsonl" in on_a_claim and "PersistentVolumeClaim kvgate-usage" in on_a_claim
