"""The engine pod template (`kvgate autoscaler --engine-pod-template`): what the platform adds to engine
pods, merged under what kvgate owns. Pure functions, checked on the Deployments they produce (each one
validated against the Kubernetes schema in strict mode)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvgate.providers.base import ReplicaSpec, engine_args
from kvgate.providers.k8s_manifests import DEFAULT_ENGINE_IMAGE, DeploymentSettings, deployment_manifest
from kvgate.providers.k8s_pod_template import parse_engine_pod_template

K8S_VERSION = "1.30"
GPU_SPEC = ReplicaSpec(model="llama-8b", source="s3://models/llama-8b", gpu_count=2)
CPU_SPEC = ReplicaSpec(model="tiny", source="builtin:tiny-llama")

PLATFORM_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "inference", "kvgate.example/tier": "gold"},
                 "annotations": {"prometheus.io/scrape": "true"}},
    "spec": {
        "imagePullSecrets": [{"name": "registry-creds"}],
        "priorityClassName": "gpu-serving",
        "serviceAccountName": "engine",
        "nodeSelector": {"cloud.example/gpu": "h100", "gpu.nvidia.com/class": "from-template"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "weights"}},
                    {"name": "hf-token", "secret": {"secretName": "hf"}}],
        "containers": [
            {"name": "engine", "image": "registry.example/kvgate:0.1.0-cuda", "imagePullPolicy": "Always",
             "env": [{"name": "HF_HOME", "value": "/var/cache/kvgate/hf"}, {"name": "POD_NAME", "value": "not-mine"}],
             "resources": {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"},
                           "limits": {"memory": "96Gi", "nvidia.com/gpu": "8"}},
             "volumeMounts": [{"name": "hf-token", "mountPath": "/etc/hf", "readOnly": True}],
             "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}},
            {"name": "log-shipper", "image": "registry.example/shipper:1"},
        ],
    },
}


def manifest(spec: ReplicaSpec = GPU_SPEC, *, template: dict | None = PLATFORM_TEMPLATE, image: str | None = None,
             node_selector: dict | None = None) -> dict[str, Any]:
    settings = DeploymentSettings(
        namespace="serving", image=image, node_selector=node_selector or {},
        pod_template=None if template is None else parse_engine_pod_template(template, "template.yaml"))
    deployment = deployment_manifest(spec, cluster="prod", pool="k8s", settings=settings, replica_ids=["r-1"])
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    return deployment


def engine_of(deployment: dict) -> dict:
    [engine] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return engine


def test_the_template_places_the_pod_as_the_platform_asks() -> None:
    pod = manifest()["spec"]["template"]["spec"]
    for key in ("imagePullSecrets", "priorityClassName", "serviceAccountName", "affinity", "securityContext"):
        assert pod[key] == PLATFORM_TEMPLATE["spec"][key]
    assert {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert [c["name"] for c in pod["containers"]] == ["engine", "log-shipper"]


def test_kvgate_owns_the_engine_command_probes_gpus_and_labels() -> None:
    deployment = manifest()
    engine = engine_of(deployment)
    assert engine["command"] == ["kvgate", "engine"]
    assert engine["args"] == engine_args(GPU_SPEC, host="0.0.0.0", port=8000, grpc_port=50051,
                                         replica_id="$(POD_NAME)", cache_dir="/var/cache/kvgate", drain_timeout_s=30.0)
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    # The Model asks for 2 GPUs: the template's 8 would strand 6 the planner never counted.
    assert engine["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
                                   "limits": {"memory": "96Gi", "nvidia.com/gpu": "2"}}
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in engine["env"]
    assert {"name": "HF_HOME", "value": "/var/cache/kvgate/hf"} in engine["env"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["kvgate.io/model"] == "llama-8b" and labels["team"] == "inference"
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 35


def test_the_template_image_is_used_unless_the_pool_names_one() -> None:
    assert engine_of(manifest())["image"] == "registry.example/kvgate:0.1.0-cuda"
    assert engine_of(manifest(image="pool.example/kvgate:pinned"))["image"] == "pool.example/kvgate:pinned"
    assert engine_of(manifest(template=None))["image"] == DEFAULT_ENGINE_IMAGE


def test_the_pools_node_selector_wins_key_by_key() -> None:
    pod = manifest(node_selector={"gpu.nvidia.com/class": "H100_NVLINK_80GB"})["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.example/gpu": "h100", "gpu.nvidia.com/class": "H100_NVLINK_80GB"}


def test_a_cache_volume_in_the_template_replaces_the_default_empty_dir() -> None:
    pod = manifest()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "weights"}}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    assert "hf-token" in volumes
    mounts = {m["mountPath"] for m in engine_of(manifest())["volumeMounts"]}
    assert mounts == {"/var/cache/kvgate", "/dev/shm", "/etc/hf"}


def test_a_cpu_model_gets_no_gpus_and_no_gpu_toleration() -> None:
    pod = manifest(CPU_SPEC, template={"spec": {"containers": [
        {"name": "engine", "resources": {"requests": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}}}]}}
                   )["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}


def test_no_template_builds_the_same_deployment_as_before() -> None:
    """Upgrading kvgate without a template must not roll every engine (the spec hash would change)."""
    empty = parse_engine_pod_template({}, "empty.yaml")
    settings = DeploymentSettings(namespace="serving", image="x/kvgate:1", node_selector={"a": "b"})
    without = deployment_manifest(GPU_SPEC, cluster="prod", pool="k8s", settings=settings, replica_ids=["r-1"])
    with_empty = deployment_manifest(GPU_SPEC, cluster="prod", pool="k8s", replica_ids=["r-1"],
                                     settings=DeploymentSettings(namespace="serving", image="x/kvgate:1",
                                                                 node_selector={"a": "b"}, pod_template=empty))
    assert without == with_empty
    # The hash kvgate wrote for this spec before pod templates existed.
    assert without["metadata"]["annotations"]["kvgate.io/spec-hash"] == "13d8382c27bc2c67"


@pytest.mark.parametrize("template,message", [
    ([], "must be a mapping with metadata and spec"),
    ({"kind": "Pod"}, "kind: unknown key; a pod template has only metadata and spec"),
    ({"metadata": {"name": "x"}}, "metadata.name: not allowed"),
    ({"metadata": {"labels": {"kvgate.io/model": "x"}}}, "metadata.labels.kvgate.io/model: the kvgate.io/ labels are kvgate's own"),
    ({"spec": {"containers": [{"name": "engine", "args": ["--x"]}]}},
     "spec.containers[0].args: kvgate sets it from the registry Model; remove it"),
    ({"spec": {"containers": [{"image": "x"}]}}, "spec.containers[0].name: required"),
    ({"spec": {"containers": [{"name": "sidecar"}]}}, "spec.containers[0].image: required for the sidecar 'sidecar'"),
    ({"spec": {"terminationGracePeriodSeconds": 5}}, "spec.terminationGracePeriodSeconds: kvgate sets it"),
    ({"spec": {"tolerations": {"key": "x"}}}, "spec.tolerations: must be a list of mappings"),
    # Shapes that passed the parse and then broke every engine start (the chart's schema catches them; a
    # hand-written --engine-pod-template file does not get that check).
    ({"spec": {"containers": [{"name": "engine", "env": {"A": "1"}}]}},
     "spec.containers[0].env: must be a list of mappings, each with a name"),
    ({"spec": {"containers": [{"name": "engine", "volumeMounts": {"mountPath": "/x"}}]}},
     "spec.containers[0].volumeMounts: must be a list of mappings, each with a mountPath"),
    ({"spec": {"containers": [{"name": "engine", "resources": {"limits": "4"}}]}},
     "spec.containers[0].resources: must be a mapping whose requests and limits map names to quantities"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}]}},
     "spec.containers[0].env: 'A' is given twice"),
    ({"spec": {"containers": [{"name": "engine"}, {"name": "engine", "image": "x"}]}},
     "spec.containers[1].name: 'engine' is taken by an earlier container"),
    ({"spec": {"restartPolicy": "Never"}}, "spec.restartPolicy: a Deployment's pods restart Always, not 'Never'"),
])
def test_a_bad_template_is_refused_naming_the_file_and_key(template: Any, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_engine_pod_template(template, "/etc/kvgate/engine-pod-template.yaml")
    assert str(caught.value).startswith("/etc/kvgate/engine-pod-template.yaml: ")
    assert message in str(caught.value)
