"""Pure Kubernetes logic of the kubernetes provider: manifests, names, labels, and objects read back.

Everything works on plain JSON-shaped dicts in the API's camelCase (what a manifest file holds and what
`ApiClient.sanitize_for_serialization` returns), so it is tested without a cluster and every manifest
can be checked against the Kubernetes schemas. No `kubernetes` import here; `providers.kubernetes` is
the shell that sends these objects.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.providers.base import ReplicaSpec, ReplicaState, engine_args
from kvgate.providers.k8s_pod_template import GPU_RESOURCE, EnginePodTemplate, merge_pod_template

# Label keys: Kubernetes keys cannot hold ':', so these stand for base.TAG_* ("kvgate:cluster" ...).
LABEL_CLUSTER = "kvgate.io/cluster"
LABEL_POOL = "kvgate.io/pool"
LABEL_MODEL = "kvgate.io/model"
LABEL_REPLICA = "kvgate.io/replica"  # on a pod: the replica id it serves (bound by the provider)
# On the Deployment: the replica ids it runs, a JSON list; spec.replicas is its length.
ANNOTATION_REPLICAS = "kvgate.io/replicas"
# On the Deployment: {replica id: the kvgate node it was started on}, JSON. The scheduler puts pods where
# it likes, so a pod's nodeName is no kvgate node (a node-pool claim is "<pool>/<cluster>/<claim>"); the
# planner counts each replica against the node it planned it on, and must find it there, pod or not.
ANNOTATION_REPLICA_NODES = "kvgate.io/replica-nodes"
ANNOTATION_SPEC_HASH = "kvgate.io/spec-hash"  # of the pod template, to roll out a changed ReplicaSpec
# On the node-pool object: the claims kvgate added to it, {cluster: {claim id: record}} as JSON.
ANNOTATION_CLAIMS = "kvgate.io/claims"
# Kubernetes >= 1.22: the ReplicaSet removes the pod with the lowest cost first on scale-down.
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

ENGINE_PORT = 8000
ENGINE_GRPC_PORT = 50051
CACHE_DIR = "/var/cache/kvgate"
# The engine image when neither the Pool's kubernetes.image nor the engine pod template names one.
DEFAULT_ENGINE_IMAGE = "ghcr.io/kvgate/kvgate:latest"
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")


def label_value(text: str) -> str:
    """`text` as a valid label value: at most 63 characters of [A-Za-z0-9._-], alphanumeric at both
    ends; text that had to change gets a short hash so two different inputs stay different."""
    cleaned = _LABEL_VALUE.sub("-", text).strip("-._")
    if cleaned == text and len(text) <= 63:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{cleaned[:54].strip('-._')}-{digest}".strip("-")


def object_name(*parts: str) -> str:
    """A DNS-1123 object name from `parts` ('kvgate', cluster, model, pool): lower-case, at most 63
    characters, with a hash suffix when shortened or changed so distinct inputs never collide."""
    joined = "-".join(parts)
    cleaned = re.sub(r"[^a-z0-9-]+", "-", joined.lower()).strip("-")
    if cleaned == joined and len(cleaned) <= 63:
        return cleaned
    digest = hashlib.sha256(joined.encode()).hexdigest()[:8]
    return f"{cleaned[:54].rstrip('-')}-{digest}"


def selector_labels(cluster: str, pool: str, model: str) -> dict[str, str]:
    return {LABEL_CLUSTER: label_value(cluster), LABEL_POOL: label_value(pool), LABEL_MODEL: label_value(model)}


def matches(labels: Mapping[str, str] | None, wanted: Mapping[str, str]) -> bool:
    """Whether `labels` hold every `wanted` pair. The provider filters on its side too, so a server
    that ignores label selectors (or a stale cache) never leaks another cluster's objects."""
    labels = labels or {}
    return all(labels.get(key) == value for key, value in wanted.items())


@dataclass(frozen=True, slots=True)
class DeploymentSettings:
    """What a pool's `kubernetes` block and the provider add to a ReplicaSpec to make a Deployment.

    `image` and `node_selector` are the Pool's (None / empty: unset, the pod template's apply);
    `pod_template` is the platform's engine pod template (see k8s_pod_template)."""

    namespace: str
    image: str | None
    node_selector: Mapping[str, str]
    drain_timeout_s: float = 30.0
    # Weights download plus load may take minutes: the startup probe allows 30 min before liveness counts.
    startup_deadline_s: int = 1800
    pod_template: EnginePodTemplate | None = None


def deployment_manifest(spec: ReplicaSpec, *, cluster: str, pool: str, settings: DeploymentSettings,
                        replica_ids: Sequence[str] = (), replica_nodes: Mapping[str, str] | None = None
                        ) -> dict[str, Any]:
    """The Deployment that runs `spec` for (cluster, pool, model), with len(replica_ids) replicas, each
    recorded on the kvgate node in `replica_nodes` it was started on.

    The container runs `kvgate engine` with base.engine_args (replica id = the pod's name through the
    downward API), limits `nvidia.com/gpu` to spec.gpu_count, is scheduled by the pool's node selector
    (tolerating the usual nvidia.com/gpu taint), is ready when /health answers, and gets
    drain_timeout_s + 5 s between SIGTERM and SIGKILL. The settings' pod template is merged under all
    that (k8s_pod_template.merge_pod_template)."""
    labels = selector_labels(cluster, pool, spec.model)
    args = engine_args(spec, host="0.0.0.0", port=ENGINE_PORT, grpc_port=ENGINE_GRPC_PORT,
                       replica_id="$(POD_NAME)", cache_dir=CACHE_DIR, drain_timeout_s=settings.drain_timeout_s)
    container: dict[str, Any] = {
        "name": "engine",
        "command": ["kvgate", "engine"],
        "args": args,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "KVGATE_CACHE_DIR", "value": CACHE_DIR}],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": ENGINE_GRPC_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                         "failureThreshold": max(1, settings.startup_deadline_s // 10)},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if spec.gpu_count:
        container["resources"] = {"limits": {GPU_RESOURCE: str(spec.gpu_count)},
                                  "requests": {GPU_RESOURCE: str(spec.gpu_count)}}
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": int(settings.drain_timeout_s) + 5,
        "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if spec.gpu_count:
        pod_spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    template = merge_pod_template(settings.pod_template.template if settings.pod_template else None,
                                  {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                                  image_override=settings.image, node_selector=settings.node_selector,
                                  default_image=DEFAULT_ENGINE_IMAGE)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": object_name("kvgate", cluster, spec.model, pool),
            "namespace": settings.namespace,
            "labels": {**labels, "app.kubernetes.io/name": "kvgate-engine", "app.kubernetes.io/managed-by": "kvgate"},
            "annotations": {ANNOTATION_REPLICAS: json.dumps(list(replica_ids)),
                            ANNOTATION_REPLICA_NODES: _nodes_json(replica_ids, replica_nodes or {}),
                            ANNOTATION_SPEC_HASH: template_hash(template)},
        },
        "spec": {
            "replicas": len(replica_ids),
            "selector": {"matchLabels": dict(labels)},
            # Never fewer ready replicas than asked while a new template rolls out.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": template,
        },
    }


def template_hash(template: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def replica_ids_of(deployment: Mapping[str, Any]) -> list[str]:
    raw = deployment.get("metadata", {}).get("annotations", {}).get(ANNOTATION_REPLICAS) or "[]"
    try:
        ids = json.loads(raw)
    except ValueError:
        return []
    return [str(i) for i in ids] if isinstance(ids, list) else []


def replica_nodes_of(deployment: Mapping[str, Any]) -> dict[str, str]:
    """{replica id: kvgate node id} as recorded on the Deployment (empty when unset or garbled: a Deployment
    written by an older kvgate)."""
    raw = deployment.get("metadata", {}).get("annotations", {}).get(ANNOTATION_REPLICA_NODES) or "{}"
    try:
        nodes = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in nodes.items()} if isinstance(nodes, dict) else {}


def _nodes_json(replica_ids: Sequence[str], replica_nodes: Mapping[str, str]) -> str:
    return json.dumps({i: replica_nodes[i] for i in replica_ids if i in replica_nodes}, sort_keys=True)


def replicas_patch(replica_ids: Sequence[str], resource_version: str | None,
                   replica_nodes: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A merge patch that sets the replica ids, their nodes and the count together. With resourceVersion set,
    the API server rejects it (409) if the Deployment changed since it was read: optimistic concurrency."""
    metadata: dict[str, Any] = {"annotations": {ANNOTATION_REPLICAS: json.dumps(list(replica_ids)),
                                                ANNOTATION_REPLICA_NODES: _nodes_json(replica_ids, replica_nodes or {})}}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return {"metadata": metadata, "spec": {"replicas": len(replica_ids)}}


def pod_replica_state(pod: Mapping[str, Any]) -> tuple[ReplicaState, str]:
    """(state, reason) of an engine pod: READY when its Ready condition is True; FAILED when the pod
    failed, or the engine container keeps crashing or cannot pull its image; STOPPED while it is being
    deleted; STARTING otherwise (pending scheduling, pulling, loading weights)."""
    status = pod.get("status", {}) or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return ReplicaState.STOPPED, ""
    if status.get("phase") in ("Failed", "Succeeded"):
        return ReplicaState.FAILED, status.get("message") or status.get("reason") or f"pod {status['phase'].lower()}"
    for container in status.get("containerStatuses", ()) or ():
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError"):
            last = ((container.get("lastState") or {}).get("terminated") or {})
            detail = last.get("message") or last.get("reason") or waiting.get("message") or ""
            return ReplicaState.FAILED, f"{waiting['reason']}: {detail}".rstrip(": ")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", ()) or ())
    return (ReplicaState.READY, "") if ready else (ReplicaState.STARTING, "")


# ---------------------------------------------------------------------------------------- node pools


@dataclass(frozen=True, slots=True)
class NodePoolRef:
    """The object kvgate resizes to add nodes: any namespaced custom resource with `spec.replicas`.

    The pool's `kubernetes.node_pool` names it as `NAME` (a Cluster API MachineDeployment,
    cluster.x-k8s.io/v1beta1, in the pool's namespace) or `GROUP/VERSION/PLURAL/NAME` for another kind
    with the same shape (e.g. a Cluster API MachinePool)."""

    group: str
    version: str
    plural: str
    name: str

    @classmethod
    def parse(cls, text: str) -> NodePoolRef:
        parts = text.split("/")
        if len(parts) == 1 and parts[0]:
            return cls("cluster.x-k8s.io", "v1beta1", "machinedeployments", parts[0])
        if len(parts) == 4 and all(parts):
            return cls(*parts)
        raise ValueError(f"node_pool {text!r}: write NAME (a Cluster API MachineDeployment) or GROUP/VERSION/PLURAL/NAME")

    def __str__(self) -> str:
        return f"{self.group}/{self.version}/{self.plural}/{self.name}"


def claims_of(pool_object: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{cluster: {claim id: record}} from the node-pool object's annotation (empty when unset/garbled)."""
    raw = pool_object.get("metadata", {}).get("annotations", {}).get(ANNOTATION_CLAIMS) or "{}"
    try:
        claims = json.loads(raw)
    except ValueError:
        return {}
    return claims if isinstance(claims, dict) else {}


def node_pool_patch(claims: Mapping[str, Any], replicas: int, resource_version: str | None) -> dict[str, Any]:
    """A merge patch recording `claims` and the new `spec.replicas` in one write (see replicas_patch)."""
    metadata: dict[str, Any] = {"annotations": {ANNOTATION_CLAIMS: json.dumps(claims, sort_keys=True)}}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return {"metadata": metadata, "spec": {"replicas": max(0, replicas)}}


def running_claims(pool_object: Mapping[str, Any]) -> set[tuple[str, str]]:
    """(cluster, claim id) pairs whose node counts as RUNNING: the node-pool controller reports
    `status.readyReplicas`; the nodes that were there before kvgate's claims count first, then claims
    in the order they were made (their `seq`). Which machine serves which claim is the controller's business."""
    claims = claims_of(pool_object)
    # `seq` orders claims across clusters (each write is guarded by resourceVersion, so no two share one).
    ordered = sorted(((record.get("seq", 0), record.get("created_at", 0.0), cluster, claim_id)
                      for cluster, records in claims.items() for claim_id, record in records.items()))
    spec_replicas = int(pool_object.get("spec", {}).get("replicas") or 0)
    ready = int((pool_object.get("status") or {}).get("readyReplicas") or 0)
    base = max(0, spec_replicas - len(ordered))
    ready_for_claims = max(0, ready - base)
    return {(cluster, claim_id) for _, _, cluster, claim_id in ordered[:ready_for_claims]}


@dataclass(frozen=True, slots=True)
class GpuNode:
    """A node of the cluster that matches the pool's node selector, with its GPUs (`nvidia.com/gpu`)."""

    name: str
    gpu_capacity: int
    gpu_allocatable: int
    ready: bool
    labels: Mapping[str, str]


def gpu_node_of(node: Mapping[str, Any]) -> GpuNode:
    status = node.get("status", {}) or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", ()) or ())
    unschedulable = bool((node.get("spec") or {}).get("unschedulable"))
    return GpuNode(name=node["metadata"]["name"],
                   gpu_capacity=int((status.get("capacity") or {}).get(GPU_RESOURCE, 0)),
                   gpu_allocatable=int((status.get("allocatable") or {}).get(GPU_RESOURCE, 0)),
                   ready=ready and not unschedulable,
                   labels=dict(node["metadata"].get("labels") or {}))


def next_seq(claims: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> int:
    """The `seq` of a new claim: one more than any recorded, in any cluster."""
    return 1 + max((int(r.get("seq", 0)) for records in claims.values() for r in records.values()), default=0)
