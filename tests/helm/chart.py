"""Rendering kvgate's Helm chart with Helm's own engine (helm-python-sdk loads Helm's Go library; there
is no `helm` binary here), a registry to render it with, and the value sets the chart tests share."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvgate"
RELEASE = "kvg"
NAMESPACE = "serving"
FULLNAME = f"{RELEASE}-kvgate"

# A fleet on the cluster the chart is installed in: one GPU model on one Kubernetes pool, in the
# release's namespace, that buys nodes by growing a Cluster API MachineDeployment. No kubeconfig: the
# provider uses the autoscaler pod's service account.
REGISTRY_FILES = {
    "pools.yaml": f"""\
apiVersion: kvgate/v1
kind: Pool
metadata:
  name: k8s-gpu
spec:
  provider: kubernetes
  max_nodes: 4
  node_boot_s: 90
  offers:
    - instance_type: h100-x8
      gpu_kind: H100
      gpu_count: 8
      gpu_memory_gib: 80
      price_usd_per_hour: 49.24
  kubernetes:
    namespace: {NAMESPACE}
    node_pool: gpu-workers
""",
    "models.yaml": """\
apiVersion: kvgate/v1
kind: Model
metadata:
  name: llama-8b
spec:
  source: s3://acme-models/llama-8b
  resources: {gpu_kinds: [H100], gpu_count: 2}
  scaling: {min_replicas: 1, max_replicas: 4}
  placement: {pools: [k8s-gpu]}
""",
}

# What a platform engineer sets for GPU engines.
ENGINE_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example/kvgate", "tag": "0.1.0-cuda12"},
    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
    "nodeSelector": {"gpu.example/class": "h100"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1", "z2"]}]}]}}},
    "priorityClassName": "inference-critical",
    "serviceAccountName": "engine",
    "env": [{"name": "HF_HOME", "value": "/var/cache/kvgate/hf"}],
    "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}}],
    "podLabels": {"team": "inference"},
}

# Fronting a vLLM fleet that runs elsewhere: static replicas, no pool, the servers' key from a Secret.
VLLM_FLEET = """\
apiVersion: kvgate/v1
kind: Model
metadata:
  name: llama-3.1-8b-instruct
spec:
  source: meta-llama/Llama-3.1-8B-Instruct
  routing:
    static_replicas:
      - {url: "http://vllm-0.vllm.inference.svc:8000", backend: vllm, api_key_env: VLLM_API_KEY}
      - {url: "http://vllm-1.vllm.inference.svc:8000", backend: vllm, api_key_env: VLLM_API_KEY}
"""

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis": {"redis": {"enabled": False},
                       "externalRedis": {"url": "rediss://kvgate@redis.example:6380/2", "existingSecret": "redis-creds"}},
    "external-redis-no-auth": {"redis": {"enabled": False}, "externalRedis": {"url": "redis://redis.example:6379/0"}},
    "ingress-and-httproute": {"gateway": {
        "ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "kvgate-tls", "hosts": ["kvgate.example.com"]}],
                    "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"}},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateways", "sectionName": "https"}],
                      "hostnames": ["kvgate.example.com"], "timeouts": {"request": "3600s"}}}},
    "gpu-engines": {"imagePullSecrets": [{"name": "regcred"}], "engine": ENGINE_VALUES,
                    "autoscaler": {"rbac": {"nodePools": [
                        {"apiGroup": "cluster.x-k8s.io", "resource": "machinedeployments", "names": ["gpu-workers"]}]}}},
    "vllm-fleet": {"registry": {"files": {"models.yaml": VLLM_FLEET}}, "gateway": {"extraEnv": [
        {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "vllm", "key": "api-key"}}}]}},
    "existing-secrets": {"adminToken": {"existingSecret": "kvgate-admin", "existingSecretKey": "token"},
                         "metricsToken": {"existingSecret": "kvgate-metrics", "existingSecretKey": "scrape-token"},
                         "redis": {"auth": {"existingSecret": "kvgate-redis", "existingSecretKey": "password"}}},
    # The usage log for billing: on an emptyDir (kept across container restarts), and on a claim (kept across pods).
    "usage-log": {"gateway": {"usageLog": {"enabled": True}}},
    "usage-log-on-a-claim": {"gateway": {"usageLog": {"enabled": True, "existingClaim": "kvgate-usage",
                                                      "mountPath": "/data/usage"}}},
    "service-monitor": {"gateway": {"serviceMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "10s",
                                                       "labels": {"release": "prometheus"}}}},
    # Everything for a kube-prometheus-stack: monitors for gateways, autoscalers and engines (in two namespaces),
    # the alert rules and the Grafana dashboard.
    "observability": {"gateway": {"serviceMonitor": {"enabled": True, "interval": "30s",
                                                     "labels": {"release": "prometheus"}}},
                      "autoscaler": {"rbac": {"engineNamespaces": ["serving", "gpu-a"]}},
                      "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
                      "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "kvgate"}},
                      "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "monitoring"}}}]}},
    "tuned": {"gateway": {"replicas": 4, "drainTimeoutSeconds": 120, "preStopSleepSeconds": 10,
                          "extraArgs": ["--member-grace-s", "300", "--max-body-bytes", "16777216"]},
              "autoscaler": {"intervalSeconds": 2, "leaseTtlSeconds": 20,
                             "rbac": {"engineNamespaces": ["serving", "gpu-a"], "readNodes": False}},
              "redis": {"persistence": {"enabled": False}}, "networkPolicy": {"enabled": False},
              "cluster": "prod", "logLevel": "DEBUG"},
}


def with_registry(values: dict[str, Any], files: dict[str, str] | None = None) -> dict[str, Any]:
    """`values` plus the registry, as `--set-file registry.files.NAME=...` would add it."""
    merged = copy.deepcopy(values)
    merged.setdefault("registry", {}).setdefault("files", dict(REGISTRY_FILES if files is None else files))
    return merged


def render(values: dict[str, Any], *, namespace: str = NAMESPACE, release: str = RELEASE) -> dict[str, str]:
    """{template path: rendered text}, as `helm template RELEASE helm/kvgate -n NAMESPACE` prints it.
    Raises helm_python's HelmValuesError (values.schema.json) or HelmRenderError (`fail`)."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=release, namespace=namespace, is_install=True)


def manifests(values: dict[str, Any], *, namespace: str = NAMESPACE, release: str = RELEASE) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for `values` (NOTES.txt and empty documents left out)."""
    found = []
    for path, text in sorted(render(values, namespace=namespace, release=release).items()):
        if path.endswith(".yaml"):
            found += [doc for doc in yaml.safe_load_all(text) if doc]
    return found


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def containers(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """("init"|"main", container) for every container of a workload's pod template."""
    pod = obj["spec"]["template"]["spec"]
    for container in pod.get("initContainers", ()):
        yield "init", container
    for container in pod["containers"]:
        yield "main", container


def engine_pod_template(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine pod template the chart renders (the ConfigMap the autoscaler mounts)."""
    config_map = find(objects, "ConfigMap", f"{FULLNAME}-engine-pod-template")
    return yaml.safe_load(config_map["data"]["pod-template.yaml"])
