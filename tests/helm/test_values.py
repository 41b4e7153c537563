"""Values the chart refuses, and how: values.schema.json names the key and what is allowed; a missing
or malformed registry stops the render with the file and document; a registry that Helm cannot judge
(schema, cross-references) stops the pods in their validate-registry init container with
`kvgate registry validate`'s own FILE:LINE problems. `helm lint` is clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import helm_python as helm
import pytest

from tests.helm.chart import CHART, FULLNAME, REGISTRY_FILES, find, manifests, render, with_registry
from tests.registry.kubelet_volume import KubeletVolume


@pytest.mark.parametrize("values,message", [
    ({"gateway": {"replicas": 0}}, "at '/gateway/replicas': minimum: got 0, want 1"),
    ({"gateway": {"replica": 3}}, "at '/gateway': additional properties 'replica' not allowed"),
    ({"gateway": {"drainTimeoutSeconds": "30s"}}, "at '/gateway/drainTimeoutSeconds': got string, want integer"),
    ({"logLevel": "VERBOSE"}, "at '/logLevel': value must be one of 'DEBUG', 'INFO', 'WARNING', 'ERROR'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"),
    ({"engine": {"resources": {"limits": {"memory": "lots"}}}}, "at '/engine/resources/limits/memory'"),
    ({"autoscaler": {"intervalSeconds": 0}}, "at '/autoscaler/intervalSeconds': exclusiveMinimum: got 0, want 0"),
    ({"cluster": "Prod_1"}, "at '/cluster': 'Prod_1' does not match pattern"),
    ({"gateway": {"httpRoute": {"enabled": True}}}, "at '/gateway/httpRoute/parentRefs': minItems: got 0, want 1"),
    ({"gateway": {"serviceMonitor": {"interval": "15 seconds"}}},
     "at '/gateway/serviceMonitor/interval': '15 seconds' does not match pattern"),
    # A token is never a plain value: it comes from a Secret.
    ({"metricsToken": {"token": "s3cret"}}, "at '/metricsToken': additional properties 'token' not allowed"),
    # A password in the URL would sit in plain values: it must come from externalRedis.existingSecret.
    ({"redis": {"enabled": False}, "externalRedis": {"url": "redis://:hunter2@redis.example:6379/0"}},
     "at '/externalRedis/url': 'redis://:hunter2@redis.example:6379/0' does not match pattern"),
])
def test_bad_values_are_refused_naming_the_key(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(with_registry(values))
    assert message in str(caught.value)


@pytest.mark.parametrize("values,message", [
    ({}, "registry: kvgate needs a registry. Pass its files with --set-file 'registry.files.models\\.yaml="),
    ({"registry": {"files": {"m.yaml": "x"}, "existingConfigMap": "mine"}},
     "registry: set registry.files or registry.existingConfigMap, not both"),
    ({"registry": {"existingConfigMap": "mine"}, "redis": {"enabled": False}},
     "redis.enabled is false and externalRedis.url is empty"),
    ({"registry": {"existingConfigMap": "mine"}, "externalRedis": {"url": "redis://r:6379/0"}},
     "externalRedis.url is set while redis.enabled is true"),
    ({"registry": {"existingConfigMap": "mine"}, "engine": {"resources": {"limits": {"nvidia.com/gpu": "8"}}}},
     "engine.resources.limits.nvidia.com/gpu: the GPU count of an engine comes from its Model's resources.gpu_count"),
    ({"registry": {"existingConfigMap": "mine"}, "prometheusRule": {"enabled": True}},
     "prometheusRule.enabled needs gateway.serviceMonitor.enabled"),
])
def test_values_that_cannot_work_fail_the_render_with_what_to_do(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(values)
    assert message in str(caught.value)


@pytest.mark.parametrize("files,message", [
    ({"models.txt": "kind: Model"}, "registry.files.models.txt: a registry file's name must end in .yaml or .yml"),
    ({"models.yaml": "  "}, "registry.files.models.yaml is empty"),
    ({"models.yaml": "apiVersion: kvgate/v1\nkind: Model\nmetadata: {name: [unclosed\n"},
     "registry.files.models.yaml, document 0: not valid YAML"),
    ({"models.yaml": REGISTRY_FILES["models.yaml"] + "---\napiVersion: kvgate/v2\nkind: Model\nmetadata: {name: b}\n"},
     "registry.files.models.yaml, document 1: apiVersion is \"kvgate/v2\"; registry documents are apiVersion: kvgate/v1"),
    ({"models.yaml": "apiVersion: kvgate/v1\nkind: Modle\nmetadata: {name: a}\n"},
     "registry.files.models.yaml, document 0: kind is \"Modle\"; allowed: Model, Adapter, Pool, Tenant"),
    ({"models.yaml": "apiVersion: kvgate/v1\nkind: Model\nspec: {}\n"},
     "registry.files.models.yaml, document 0: metadata.name is missing"),
])
def test_a_registry_helm_can_see_is_broken_fails_the_render(files: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(with_registry({}, files))
    assert message in str(caught.value)


def run_validate_registry_init(objects: list, registry_dir: Path) -> subprocess.CompletedProcess:
    """The gateway's validate-registry init container as the kubelet would run it: its command and args
    from the rendered Deployment, with the ConfigMap mounted (kubelet layout) at `registry_dir`."""
    deployment = find(objects, "Deployment", f"{FULLNAME}-gateway")
    [init] = deployment["spec"]["template"]["spec"]["initContainers"]
    [mount] = [m for m in init["volumeMounts"] if m["name"] == "registry"]
    args = [str(registry_dir) if a == mount["mountPath"] else a for a in init["args"]]
    assert init["command"] == ["kvgate"]
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=60)


def test_a_registry_that_does_not_validate_stops_the_pods_with_file_and_line(tmp_path: Path) -> None:
    # A well-formed document (Helm renders it) that kvgate refuses: min_replicas above max_replicas.
    files = {**REGISTRY_FILES, "models.yaml": REGISTRY_FILES["models.yaml"].replace(
        "scaling: {min_replicas: 1, max_replicas: 4}", "scaling: {min_replicas: 5, max_replicas: 4}")}
    objects = manifests(with_registry({}, files))
    config_map = find(objects, "ConfigMap", f"{FULLNAME}-registry")
    volume = KubeletVolume(tmp_path / "registry")
    volume.publish(config_map["data"])
    done = run_validate_registry_init(objects, volume.root)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: 1 problem in {volume.root}")
    assert (f"{volume.root}/models.yaml:8: Model/llama-8b: spec.scaling.min_replicas: min_replicas (5) is greater "
            "than max_replicas (4)") in done.stderr


def test_a_valid_registry_passes_the_init_container(tmp_path: Path) -> None:
    objects = manifests(with_registry({}))
    volume = KubeletVolume(tmp_path / "registry")
    volume.publish(find(objects, "ConfigMap", f"{FULLNAME}-registry")["data"])
    done = run_validate_registry_init(objects, volume.root)
    assert done.returncode == 0, done.stderr
    assert "valid (1 Model" in done.stdout


def test_helm_lint_is_clean() -> None:
    for values in (with_registry({}), {}):  # lint without values too: `helm lint helm/kvgate`
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == []
        # Severity 1 is INFO (only "icon is recommended": the project has no icon to point at).
        assert [m for m in report["messages"] if m["severity"] > 1] == []
