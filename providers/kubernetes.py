"""The `kubernetes` provider: replicas as Deployments, nodes through a resizable node-pool object.

The only module that imports the official `kubernetes` client; its blocking calls run in worker threads.
Manifests and the reading of objects are pure functions in `k8s_manifests`.

How the Provider contract maps onto Kubernetes:
- Replicas: one Deployment per (cluster, model, pool), named `kvgate-<cluster>-<model>-<pool>`. Replicas
  are *named*: the Deployment's annotation `kvgate.io/replicas` lists the replica ids it runs and
  `spec.replicas` is their count, written together in one merge patch guarded by resourceVersion
  (optimistic concurrency). So `start_replica` is idempotent on `replica_id` (= scale +1 for a new id)
  and `stop_replica(id)` scales by -1 after marking that replica's pod with the lowest
  `controller.kubernetes.io/pod-deletion-cost`, so the ReplicaSet removes exactly that pod. Pods are
  bound to ids by the `kvgate.io/replica` label, which `list_replicas` sets on new pods (oldest pod to
  the oldest unbound id). A replica's URL is its pod IP; READY is the pod's Ready condition, which is
  the readiness probe on `/health`. The scheduler places pods by the pool's node selector: the
  `node_id` given to `start_replica` must be a known, ready node, but is not a pin.
  The drain deadline is the pod's terminationGracePeriodSeconds (the provider's drain_timeout_s + 5 s);
  the per-call `drain_deadline_s` of `stop_replica` is not applied.
- Nodes: the pool's `kubernetes.node_pool` names an object with `spec.replicas` (by default a Cluster
  API MachineDeployment in the pool's namespace, see `NodePoolRef`). `create(claim)` records the claim
  in the object's `kvgate.io/claims` annotation and raises `spec.replicas` by one, in one guarded
  patch; `delete` removes the claim and lowers it by one (which machine goes is the controller's
  choice). `list()` returns this cluster's claims as Nodes: RUNNING once the controller's
  `status.readyReplicas` covers them, PENDING before. A pool without `node_pool` cannot buy nodes: its
  offerings are all `available=False` and `create` raises `InsufficientCapacity`; replicas still run
  on the cluster's own GPU nodes (`gpu_nodes()`).
- Namespace, kubeconfig and context come from the pool's `kubernetes` block; without a kubeconfig the
  in-cluster service account is used.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.config.config_exception import ConfigException

from kvgate.clock import Clock
from kvgate.providers.base import (
    TAG_CLAIM, TAG_CLUSTER, TAG_MODEL, TAG_POOL, InsufficientCapacity, Node, NodeClaim, NodeNotReady, NodeState,
    NotFound, Offering, ProviderError, ProviderUnavailable, ReplicaHandle, ReplicaSpec,
    ReplicaState, check_quota, offerings_from_pool,
)
from kvgate.providers.k8s_manifests import (
    ANNOTATION_DELETION_COST, ANNOTATION_SPEC_HASH, ENGINE_GRPC_PORT, ENGINE_PORT, LABEL_CLUSTER, LABEL_MODEL,
    LABEL_POOL, LABEL_REPLICA, DeploymentSettings, GpuNode, NodePoolRef, claims_of, deployment_manifest,
    gpu_node_of, label_value, matches, next_seq, node_pool_patch, pod_replica_state, replica_ids_of, replica_nodes_of,
    replicas_patch, running_claims,
)
from kvgate.providers.k8s_pod_template import EnginePodTemplate
from kvgate.providers.pool_provider import PoolProvider, Sleep
from kvgate.registry.schema import CapacityType, KubernetesSettings, PoolSpec

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
_LOWEST_DELETION_COST = str(-(2 ** 31))  # int32 minimum: removed before any other pod
_CONFLICT_ATTEMPTS = 5  # read-modify-write rounds before a lost race becomes ProviderUnavailable


class _Conflict(ProviderError):
    """409 from the API server: the object changed since it was read (or already exists)."""

    retryable = True


def api_client_for(settings: KubernetesSettings) -> Any:
    """An ApiClient from the pool's kubeconfig (and context), else from the in-cluster service account.
    Raises ProviderError with what to fix when neither works."""
    try:
        if settings.kubeconfig:
            return k8s_config.new_client_from_config(config_file=settings.kubeconfig, context=settings.context)
        configuration = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s.ApiClient(configuration)
    except (ConfigException, OSError, TypeError, ValueError) as exc:
        where = f"kubeconfig {settings.kubeconfig!r}" if settings.kubeconfig else "the in-cluster service account"
        raise ProviderError(f"cannot configure a Kubernetes client from {where}: {exc}; set the pool's "
                            "kubernetes.kubeconfig (and context), or run kvgate inside the cluster") from None


class KubernetesProvider(PoolProvider):
    """One Kubernetes pool of one kvgate cluster (see the module docstring for the mapping).

    `api_client` overrides the client built from the pool's settings; `sleep` waits between retries
    of 429/5xx answers (default: `clock.sleep`); `drain_timeout_s` sets the pods' grace period;
    `pod_template` is the platform's engine pod template, merged under what kvgate owns (k8s_pod_template)."""

    def __init__(self, pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, api_client: Any | None = None,
                 sleep: Sleep | None = None, drain_timeout_s: float = 30.0, max_attempts: int = 4,
                 pod_template: EnginePodTemplate | None = None) -> None:
        super().__init__(pool_name, cluster=cluster, clock=clock, sleep=sleep)
        self._spec = spec
        self._settings = spec.kubernetes or KubernetesSettings()
        self._max_attempts = max_attempts
        try:
            self._node_pool = NodePoolRef.parse(self._settings.node_pool) if self._settings.node_pool else None
        except ValueError as exc:
            raise ProviderError(f"pool {pool_name!r}: {exc}") from None
        self._deployment_settings = DeploymentSettings(
            namespace=self._settings.namespace, image=self._settings.image,
            node_selector=dict(self._settings.node_selector), drain_timeout_s=drain_timeout_s,
            pod_template=pod_template)
        self._catalogue = offerings_from_pool(pool_name, spec)
        self._api = api_client or api_client_for(self._settings)
        self._apps = k8s.AppsV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)
        self._custom = k8s.CustomObjectsApi(self._api)
        self._own_labels = {LABEL_CLUSTER: label_value(cluster), LABEL_POOL: label_value(pool_name)}

    @property
    def namespace(self) -> str:
        return self._settings.namespace

    # ------------------------------------------------------------------------------------- the calls

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call in a thread; the answer as plain camelCase JSON. 404 -> NotFound, 409 -> _Conflict,
        429/5xx and connection errors retried with backoff then ProviderUnavailable, others ProviderError."""
        name = getattr(method, "__name__", "call")
        for attempt in range(self._max_attempts):
            try:
                answer = await asyncio.to_thread(method, *args, **kwargs)
                return self._api.sanitize_for_serialization(answer)
            except k8s.ApiException as exc:
                status = exc.status or 0
                text = f"Kubernetes {name}: {status} {exc.reason}"
                if status == 404:
                    raise NotFound(text) from None
                if status == 409:
                    raise _Conflict(text) from None
                if status in (401, 403):
                    raise ProviderError(f"{text}: check the credentials and RBAC of the kvgate service account "
                                        f"in namespace {self.namespace!r}") from None
                if status != 429 and status < 500:
                    raise ProviderError(f"{text}: {exc.body}"[:2000]) from None
                error: ProviderError = ProviderUnavailable(text)
            except urllib3.exceptions.HTTPError as exc:
                error = ProviderUnavailable(f"Kubernetes {name}: {exc}")
            if attempt == self._max_attempts - 1:
                raise error
            await self._sleep(min(8.0, 0.5 * 2 ** attempt))
        raise AssertionError("unreachable: the loop returns or raises")

    # ---------------------------------------------------------------------------------- offerings

    async def offerings(self) -> list[Offering]:
        """The pool's catalogue; every offering is unavailable when the pool has no node_pool to grow."""
        return [replace(o, available=self._node_pool is not None) for o in self._catalogue]

    async def gpu_nodes(self) -> list[GpuNode]:
        """The cluster's nodes that match the pool's node selector and have GPUs (`nvidia.com/gpu`
        capacity > 0; every matching node for a CPU-only pool), sorted by name."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(self._settings.node_selector.items()))
        answer = await self._call(self._core.list_node, label_selector=selector or None)
        wants_gpus = any(o.gpu_count for o in self._catalogue)
        nodes = [gpu_node_of(item) for item in answer.get("items", ())
                 if matches(item.get("metadata", {}).get("labels"), self._settings.node_selector)]
        return sorted((n for n in nodes if n.gpu_capacity > 0 or not wants_gpus), key=lambda n: n.name)

    # -------------------------------------------------------------------------------------- nodes

    async def _pool_object(self) -> dict[str, Any]:
        ref = self._node_pool
        assert ref is not None
        try:
            return await self._call(self._custom.get_namespaced_custom_object, ref.group, ref.version,
                                    self.namespace, ref.plural, ref.name)
        except NotFound:
            raise ProviderError(f"pool {self._pool!r}: node pool {ref} not found in namespace {self.namespace!r}") from None

    async def _patch_pool_object(self, body: dict[str, Any]) -> None:
        ref = self._node_pool
        assert ref is not None
        await self._call(self._custom.patch_namespaced_custom_object, ref.group, ref.version, self.namespace,
                         ref.plural, ref.name, body)

    def _node_id(self, claim_id: str) -> str:
        assert self._node_pool is not None
        return f"{self._node_pool.name}/{self._cluster}/{claim_id}"

    def _node(self, claim_id: str, record: dict[str, Any], running: bool) -> Node:
        capacity = CapacityType(record.get("capacity_type", CapacityType.ON_DEMAND.value))
        instance_type = record.get("instance_type", "")
        price = next((o.price_usd_per_hour for o in self._catalogue
                      if o.instance_type == instance_type and o.capacity_type is capacity), 0.0)
        tags = {**record.get("labels", {}), TAG_CLUSTER: self._cluster, TAG_CLAIM: claim_id, TAG_POOL: self._pool}
        if record.get("model"):
            tags[TAG_MODEL] = record["model"]
        return Node(id=self._node_id(claim_id), claim_id=claim_id, pool=self._pool, instance_type=instance_type,
                    capacity_type=capacity, zone=record.get("zone", ""),
                    state=NodeState.RUNNING if running else NodeState.PENDING, address=None, tags=tags,
                    launched_at=float(record.get("created_at", 0.0)), price_usd_per_hour=price)

    async def create(self, claim: NodeClaim) -> Node:
        """Grow the node pool by one for `claim`, or return the node already recorded for it.
        Raises NotFound (offering not sold here), InsufficientCapacity (no node_pool to grow),
        QuotaExceeded (max_nodes / max_gpus / budget_usd_per_hour of the pool), ProviderError/ProviderUnavailable (API)."""
        offering = next((o for o in self._catalogue if o.key == claim.offering), None)
        if offering is None:
            raise NotFound(f"pool {self._pool!r} does not sell {claim.offering}")
        if self._node_pool is None:
            raise InsufficientCapacity(claim.offering, f"pool {self._pool!r} names no kubernetes.node_pool: its nodes "
                                       "are the cluster's own and kvgate cannot add any")
        for _ in range(_CONFLICT_ATTEMPTS):
            obj = await self._pool_object()
            claims = claims_of(obj)
            mine = claims.setdefault(self._cluster, {})
            if claim.id in mine:
                return self._node(claim.id, mine[claim.id], (self._cluster, claim.id) in running_claims(obj))
            replicas = int(obj.get("spec", {}).get("replicas") or 0)
            self._check_quota(replicas, offering)
            mine[claim.id] = {"instance_type": offering.instance_type, "capacity_type": offering.capacity_type.value,
                              "zone": offering.zone, "model": claim.model, "created_at": self._clock.wall(),
                              "seq": next_seq(claims),
                              "labels": dict(claim.labels)}
            try:
                await self._patch_pool_object(node_pool_patch(claims, replicas + 1,
                                                              obj.get("metadata", {}).get("resourceVersion")))
            except _Conflict:
                continue  # someone else changed the pool object: read it again
            log.info("pool %s: node pool %s grown to %d for claim %s", self._pool, self._node_pool, replicas + 1, claim.id)
            return self._node(claim.id, mine[claim.id], False)
        raise ProviderUnavailable(f"pool {self._pool!r}: node pool {self._node_pool} kept changing under us")

    def _check_quota(self, replicas: int, offering: Offering) -> None:
        # Every node of the node pool is of this one offering.
        check_quota(self._pool, offering, [(offering.gpu_count, offering.price_usd_per_hour)] * replicas,
                    max_nodes=self._spec.max_nodes, max_gpus=self._spec.max_gpus,
                    budget_usd_per_hour=self._spec.budget_usd_per_hour)

    async def delete(self, node_id: str) -> None:
        """Remove the claim and shrink the node pool by one; unknown ids and other clusters' nodes succeed
        without a change."""
        if self._node_pool is None or not node_id.startswith(f"{self._node_pool.name}/{self._cluster}/"):
            return
        claim_id = node_id.removeprefix(f"{self._node_pool.name}/{self._cluster}/")
        for _ in range(_CONFLICT_ATTEMPTS):
            obj = await self._pool_object()
            claims = claims_of(obj)
            if claim_id not in claims.get(self._cluster, {}):
                return
            del claims[self._cluster][claim_id]
            replicas = int(obj.get("spec", {}).get("replicas") or 0)
            try:
                await self._patch_pool_object(node_pool_patch(claims, replicas - 1,
                                                              obj.get("metadata", {}).get("resourceVersion")))
                return
            except _Conflict:
                continue
        raise ProviderUnavailable(f"pool {self._pool!r}: node pool {self._node_pool} kept changing under us")

    async def list(self) -> list[Node]:
        """This cluster's claims on the node pool as Nodes (none without a node_pool), sorted by id."""
        if self._node_pool is None:
            return []
        obj = await self._pool_object()
        running = running_claims(obj)
        mine = claims_of(obj).get(self._cluster, {})
        return sorted((self._node(cid, rec, (self._cluster, cid) in running) for cid, rec in mine.items()),
                      key=lambda n: n.id)

    # ----------------------------------------------------------------------------------- replicas

    async def _check_node(self, node_id: str) -> None:
        """NotFound unless `node_id` is one of our claim nodes or a node of the cluster; NodeNotReady
        unless it is RUNNING / Ready."""
        for node in await self.list():
            if node.id == node_id:
                if node.state is not NodeState.RUNNING:
                    raise NodeNotReady(f"node {node_id} is {node.state.value}, not running")
                return
        try:
            raw = await self._call(self._core.read_node, node_id)
        except NotFound:
            raise NotFound(f"pool {self._pool!r} has no node {node_id!r}") from None
        if not gpu_node_of(raw).ready:
            raise NodeNotReady(f"node {node_id} is not Ready (or is cordoned)")

    async def start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None = None) -> ReplicaHandle:
        """Add replica `replica_id` (new: a generated id) to the model's Deployment, creating it when
        absent and rolling out a changed ReplicaSpec; idempotent on `replica_id`. Returns it STARTING
        (or as it is, when it already runs). NotFound / NodeNotReady for `node_id` (see the module docstring)."""
        await self._check_node(node_id)
        replica_id = replica_id or f"{spec.model}-{uuid.uuid4().hex[:8]}"
        manifest = deployment_manifest(spec, cluster=self._cluster, pool=self._pool,
                                       settings=self._deployment_settings, replica_ids=[replica_id],
                                       replica_nodes={replica_id: node_id})
        name = manifest["metadata"]["name"]
        for _ in range(_CONFLICT_ATTEMPTS):
            try:
                current = await self._call(self._apps.read_namespaced_deployment, name, self.namespace)
            except NotFound:
                try:
                    await self._call(self._apps.create_namespaced_deployment, self.namespace, manifest)
                except _Conflict:
                    continue  # created meanwhile by another kvgate: read it
                log.info("pool %s: created deployment %s with replica %s", self._pool, name, replica_id)
                return self._starting(replica_id, spec.model)
            ids = replica_ids_of(current)
            if replica_id in ids:
                existing = [h for h in await self.list_replicas() if h.id == replica_id]
                return existing[0] if existing else self._starting(replica_id, spec.model)
            patch = replicas_patch(ids + [replica_id], current.get("metadata", {}).get("resourceVersion"),
                                   {**replica_nodes_of(current), replica_id: node_id})
            wanted_hash = manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
            if current.get("metadata", {}).get("annotations", {}).get(ANNOTATION_SPEC_HASH) != wanted_hash:
                # A changed ReplicaSpec (registry reload): roll the new template out with this scale-up.
                patch["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = wanted_hash
                patch["spec"]["template"] = manifest["spec"]["template"]
            try:
                await self._call(self._apps.patch_namespaced_deployment, name, self.namespace, patch,
                                 _content_type=MERGE_PATCH)
            except _Conflict:
                continue
            return self._starting(replica_id, spec.model)
        raise ProviderUnavailable(f"deployment {name} kept changing under us")

    def _starting(self, replica_id: str, model: str) -> ReplicaHandle:
        return ReplicaHandle(id=replica_id, model=model, node_id="", url="", grpc_target=None,
                             state=ReplicaState.STARTING, started_at=self._clock.wall())

    async def _own_deployments(self) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(self._own_labels.items()))
        answer = await self._call(self._apps.list_namespaced_deployment, self.namespace, label_selector=selector)
        return [d for d in answer.get("items", ()) if matches(d.get("metadata", {}).get("labels"), self._own_labels)]

    async def _pods_of(self, deployment: dict[str, Any]) -> list[dict[str, Any]]:
        wanted = deployment.get("spec", {}).get("selector", {}).get("matchLabels", {})
        selector = ",".join(f"{k}={v}" for k, v in sorted(wanted.items()))
        answer = await self._call(self._core.list_namespaced_pod, self.namespace, label_selector=selector)
        return [p for p in answer.get("items", ()) if matches(p.get("metadata", {}).get("labels"), wanted)]

    async def list_replicas(self) -> list[ReplicaHandle]:
        """Every replica id of this cluster's Deployments in the pool, with its pod's address and state
        (STARTING with no URL until a pod serves it). New pods are bound to unserved ids here."""
        handles = []
        for deployment in await self._own_deployments():
            ids = replica_ids_of(deployment)
            nodes = replica_nodes_of(deployment)
            model = deployment["metadata"]["labels"].get(LABEL_MODEL, "")
            pods = await self._pods_of(deployment)
            bound = {p["metadata"]["labels"][LABEL_REPLICA]: p for p in pods
                     if p["metadata"]["labels"].get(LABEL_REPLICA) in ids}
            free_pods = sorted((p for p in pods if LABEL_REPLICA not in p["metadata"]["labels"]
                                and not p["metadata"].get("deletionTimestamp")),
                               key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
            for replica_id, pod in zip([i for i in ids if i not in bound], free_pods):
                await self._call(self._core.patch_namespaced_pod, pod["metadata"]["name"], self.namespace,
                                 {"metadata": {"labels": {LABEL_REPLICA: replica_id}}})
                bound[replica_id] = pod
            for replica_id in ids:
                handles.append(self._handle(replica_id, model, bound.get(replica_id), nodes.get(replica_id)))
        return sorted(handles, key=lambda h: h.id)

    def _handle(self, replica_id: str, model: str, pod: dict[str, Any] | None, node_id: str | None) -> ReplicaHandle:
        """The replica's handle, on the kvgate node it was started on (else its pod's node, for a Deployment
        an older kvgate wrote): the planner finds it where it counted it, before its pod exists too."""
        if pod is None:
            return ReplicaHandle(id=replica_id, model=model, node_id=node_id or "", url="", grpc_target=None,
                                 state=ReplicaState.STARTING, started_at=0.0)
        state, reason = pod_replica_state(pod)
        ip = (pod.get("status") or {}).get("podIP") or ""
        created = pod["metadata"].get("creationTimestamp")
        started_at = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() if created else 0.0
        return ReplicaHandle(id=replica_id, model=model, node_id=node_id or (pod.get("spec") or {}).get("nodeName") or "",
                             url=f"http://{ip}:{ENGINE_PORT}" if ip else "",
                             grpc_target=f"{ip}:{ENGINE_GRPC_PORT}" if ip else None,
                             state=state, started_at=started_at, reason=reason)

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None:
        """Scale the replica's Deployment down by one, making its pod the one the ReplicaSet removes.
        Unknown or stopped ids succeed. The pod drains for its terminationGracePeriodSeconds."""
        for _ in range(_CONFLICT_ATTEMPTS):
            for deployment in await self._own_deployments():
                ids = replica_ids_of(deployment)
                if replica_id not in ids:
                    continue
                for pod in await self._pods_of(deployment):
                    if pod["metadata"]["labels"].get(LABEL_REPLICA) == replica_id:
                        await self._call(self._core.patch_namespaced_pod, pod["metadata"]["name"], self.namespace,
                                         {"metadata": {"annotations": {ANNOTATION_DELETION_COST: _LOWEST_DELETION_COST}}})
                patch = replicas_patch([i for i in ids if i != replica_id],
                                       deployment["metadata"].get("resourceVersion"), replica_nodes_of(deployment))
                try:
                    await self._call(self._apps.patch_namespaced_deployment, deployment["metadata"]["name"],
                                     self.namespace, patch, _content_type=MERGE_PATCH)
                except _Conflict:
                    break  # read again
                return
            else:
                return  # no Deployment runs this id
        raise ProviderUnavailable(f"the deployment of replica {replica_id} kept changing under us")

    async def close(self) -> None:
        """Close the client's connection pool; Deployments and nodes stay."""
        await asyncio.to_thread(self._api.close)


def from_pool(pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, **options: Any) -> KubernetesProvider:
    """`build_provider`'s entry: options are KubernetesProvider's keywords (api_client, sleep,
    drain_timeout_s, max_attempts, pod_template)."""
    return KubernetesProvider(pool_name, spec, cluster=cluster, clock=clock, **options)
