"""KubernetesProvider against `kmock`, a Kubernetes API emulator served over real HTTP on a loopback
port, reached by the official `kubernetes` client through a kubeconfig file (`kube_world`).

What kmock models: objects stored per resource, namespace and name; create (409 on a duplicate),
read, list, merge patch, delete (404 when missing), and canned error statuses. What it does not:
controllers (no ReplicaSet turns a Deployment into pods, no node-pool controller makes machines) and
label selectors (ignored: every list returns everything). So these tests assert on the objects the
provider writes, and play the controllers by writing pods, nodes and node-pool status themselves, as
the real ones would. Every manifest the provider generates, and every Deployment as stored after the
provider's patches, is validated against the Kubernetes schemas with `kubernetes-validate`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvgate.clock import FakeClock
from kvgate.providers.base import (
    InsufficientCapacity, NodeNotReady, NodeState, NotFound, ProviderError, ProviderUnavailable, QuotaExceeded,
    ReplicaSpec, ReplicaState, engine_args,
)
from kvgate.providers.k8s_manifests import (
    ANNOTATION_CLAIMS, ANNOTATION_DELETION_COST, ANNOTATION_REPLICAS, LABEL_REPLICA, DeploymentSettings, NodePoolRef,
    deployment_manifest, label_value, object_name, pod_replica_state,
)
from kvgate.providers.k8s_pod_template import parse_engine_pod_template
from kvgate.providers.kubernetes import KubernetesProvider
from kvgate.registry.schema import PoolSpec
from tests.providers.subject_kubernetes import NAMESPACE, POOL, KubeWorld, claim, kube_world, pool_spec

K8S_VERSION = "1.30"  # the oldest Kubernetes we promise to support
DEPLOYMENTS = "apps/v1/deployments"
SPEC = ReplicaSpec(model="llama-8b", source="builtin:tiny-llama", gpu_count=1, max_model_len=1024)
GPU_LABELS = {"gpu.nvidia.com/class": "A100_NVLINK_80GB"}


def valid(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` if the Kubernetes schema (strict: unknown fields are errors) accepts it."""
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    return manifest


def stored(world: KubeWorld, resource: str, name: str, namespace: str | None = NAMESPACE) -> dict[str, Any]:
    """The object as kmock holds it, without the fields only a real API server would fill in."""
    obj = json.loads(json.dumps(world.emulator.objects[resource, namespace, name].raw))
    obj.get("metadata", {}).pop("resourceVersion", None)
    return obj


class Sleeps(list):
    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[KubeWorld]:
    async with kube_world(tmp_path) as world:
        add_node(world, "gpu-a", gpus=8)
        yield world


@pytest.fixture
async def provider(world: KubeWorld) -> AsyncIterator[KubernetesProvider]:
    provider = KubernetesProvider(POOL, pool_spec(world.kubeconfig), cluster="prod", clock=FakeClock(), sleep=Sleeps())
    yield provider
    await provider.close()


def add_node(world: KubeWorld, name: str, *, gpus: int, ready: bool = True, labels: dict | None = None) -> None:
    """A node as the kubelet and the NVIDIA device plugin report it."""
    world.emulator.objects["v1/nodes", None, name] = {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels if labels is not None else GPU_LABELS},
        "status": {"capacity": {"cpu": "128", "nvidia.com/gpu": str(gpus)},
                   "allocatable": {"cpu": "127", "nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def add_pod(world: KubeWorld, deployment: dict, name: str, *, ip: str, ready: bool, created: str,
            waiting: str | None = None) -> None:
    """A pod as the ReplicaSet controller, scheduler and kubelet would leave it."""
    status: dict[str, Any] = {"phase": "Running", "podIP": ip,
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if waiting:
        status["containerStatuses"] = [{"name": "engine", "ready": False, "restartCount": 4, "image": "x", "imageID": "",
                                        "state": {"waiting": {"reason": waiting}},
                                        "lastState": {"terminated": {"exitCode": 1, "message": "CUDA out of memory"}}}]
    world.emulator.objects["v1/pods", NAMESPACE, name] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": created,
                     "labels": dict(deployment["spec"]["selector"]["matchLabels"])},
        "spec": {"nodeName": "gpu-a", "containers": deployment["spec"]["template"]["spec"]["containers"]},
        "status": status}


# ------------------------------------------------------------------------------------------ replicas


async def test_start_replica_creates_a_valid_deployment(world: KubeWorld, provider: KubernetesProvider) -> None:
    handle = await provider.start_replica("gpu-a", SPEC, replica_id="r-1")
    assert (handle.id, handle.state, handle.url) == ("r-1", ReplicaState.STARTING, "")
    name = object_name("kvgate", "prod", "llama-8b", POOL)
    deployment = valid(stored(world, DEPLOYMENTS, name))
    assert deployment["spec"]["replicas"] == 1
    assert json.loads(deployment["metadata"]["annotations"][ANNOTATION_REPLICAS]) == ["r-1"]
    assert deployment["metadata"]["labels"]["kvgate.io/cluster"] == "prod"
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "kvgate.io/cluster": "prod", "kvgate.io/pool": POOL, "kvgate.io/model": "llama-8b"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == GPU_LABELS
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/kvgate/kvgate:test" and container["command"] == ["kvgate", "engine"]
    assert container["args"] == engine_args(SPEC, host="0.0.0.0", port=8000, grpc_port=50051, replica_id="$(POD_NAME)",
                                            cache_dir="/var/cache/kvgate", drain_timeout_s=30.0)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["terminationGracePeriodSeconds"] == 35


async def test_replicas_are_named_and_scale_by_one(world: KubeWorld, provider: KubernetesProvider) -> None:
    name = object_name("kvgate", "prod", "llama-8b", POOL)
    await provider.start_replica("gpu-a", SPEC, replica_id="r-1")
    await provider.start_replica("gpu-a", SPEC, replica_id="r-1")  # idempotent
    assert stored(world, DEPLOYMENTS, name)["spec"]["replicas"] == 1
    await provider.start_replica("gpu-a", SPEC, replica_id="r-2")
    deployment = valid(stored(world, DEPLOYMENTS, name))
    assert deployment["spec"]["replicas"] == 2
    assert json.loads(deployment["metadata"]["annotations"][ANNOTATION_REPLICAS]) == ["r-1", "r-2"]

    # The ReplicaSet controller's work: two pods, the older one ready.
    add_pod(world, deployment, "engine-b", ip="10.0.0.12", ready=False, created="2026-01-01T00:00:05Z")
    add_pod(world, deployment, "engine-a", ip="10.0.0.11", ready=True, created="2026-01-01T00:00:01Z")
    replicas = {h.id: h for h in await provider.list_replicas()}
    assert {i: (h.state, h.url, h.node_id) for i, h in replicas.items()} == {
        "r-1": (ReplicaState.READY, "http://10.0.0.11:8000", "gpu-a"),
        "r-2": (ReplicaState.STARTING, "http://10.0.0.12:8000", "gpu-a")}
    assert replicas["r-1"].grpc_target == "10.0.0.11:50051"
    assert stored(world, "v1/pods", "engine-a")["metadata"]["labels"][LABEL_REPLICA] == "r-1"  # bound, oldest first

    await provider.stop_replica("r-1")
    await provider.stop_replica("r-1")  # stopped already: no error, no change
    await provider.stop_replica("no-such-replica")
    after = valid(stored(world, DEPLOYMENTS, name))
    assert after["spec"]["replicas"] == 1
    assert json.loads(after["metadata"]["annotations"][ANNOTATION_REPLICAS]) == ["r-2"]
    # The ReplicaSet removes exactly r-1's pod: it has the lowest deletion cost.
    assert stored(world, "v1/pods", "engine-a")["metadata"]["annotations"][ANNOTATION_DELETION_COST] == str(-(2 ** 31))
    assert ANNOTATION_DELETION_COST not in stored(world, "v1/pods", "engine-b")["metadata"].get("annotations", {})
    assert [h.id for h in await provider.list_replicas()] == ["r-2"]


async def test_a_replica_is_listed_on_the_kvgate_node_it_was_started_on(world: KubeWorld,
                                                                        provider: KubernetesProvider) -> None:
    """A node-pool node's id is kvgate's ("gpu-workers/prod/<claim>"); the scheduler puts the pod on some
    Kubernetes node. The planner counts a replica against the node it started it on, so the replica must be
    listed there, pod or not: listed on "" (no pod yet) or on the pod's nodeName, it counted nowhere, and the
    live loop started another replica every tick."""
    node = await provider.create(claim())
    world.set_node_pool(status={"readyReplicas": 1})
    await provider.start_replica(node.id, SPEC, replica_id="r-1")
    assert [(h.id, h.node_id) for h in await provider.list_replicas()] == [("r-1", node.id)]  # no pod yet
    deployment = stored(world, DEPLOYMENTS, object_name("kvgate", "prod", "llama-8b", POOL))
    add_pod(world, deployment, "engine-a", ip="10.0.0.11", ready=True, created="2026-01-01T00:00:01Z")
    [handle] = await provider.list_replicas()
    assert (handle.state, handle.node_id) == (ReplicaState.READY, node.id)  # the pod runs on gpu-a
    await provider.start_replica("gpu-a", SPEC, replica_id="r-2")
    await provider.stop_replica("r-1")
    assert [(h.id, h.node_id) for h in await provider.list_replicas()] == [("r-2", "gpu-a")]


async def test_replicas_of_another_cluster_are_not_listed(world: KubeWorld, provider: KubernetesProvider) -> None:
    """kmock answers every list with everything (it ignores label selectors), so this checks that the
    provider filters by its own labels too, as it must against a stale cache or a careless proxy."""
    other = KubernetesProvider(POOL, pool_spec(world.kubeconfig), cluster="staging", clock=FakeClock())
    try:
        await provider.start_replica("gpu-a", SPEC, replica_id="prod-1")
        await other.start_replica("gpu-a", SPEC, replica_id="staging-1")
        assert [h.id for h in await provider.list_replicas()] == ["prod-1"]
        assert [h.id for h in await other.list_replicas()] == ["staging-1"]
        await provider.stop_replica("staging-1")  # not ours: no change
        assert [h.id for h in await other.list_replicas()] == ["staging-1"]
    finally:
        await other.close()


async def test_a_crashing_engine_is_reported_failed_with_the_reason(world: KubeWorld,
                                                                    provider: KubernetesProvider) -> None:
    await provider.start_replica("gpu-a", SPEC, replica_id="r-1")
    deployment = stored(world, DEPLOYMENTS, object_name("kvgate", "prod", "llama-8b", POOL))
    add_pod(world, deployment, "engine-a", ip="10.0.0.11", ready=False, created="2026-01-01T00:00:01Z",
            waiting="CrashLoopBackOff")
    [replica] = await provider.list_replicas()
    assert replica.state is ReplicaState.FAILED and "CUDA out of memory" in replica.reason


async def test_a_changed_replica_spec_rolls_out_a_valid_template(world: KubeWorld,
                                                                 provider: KubernetesProvider) -> None:
    name = object_name("kvgate", "prod", "llama-8b", POOL)
    await provider.start_replica("gpu-a", SPEC, replica_id="r-1")
    bigger = ReplicaSpec(model="llama-8b", source="builtin:tiny-llama", gpu_count=2, max_model_len=4096)
    await provider.start_replica("gpu-a", bigger, replica_id="r-2")
    deployment = valid(stored(world, DEPLOYMENTS, name))
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"} and "4096" in container["args"]
    assert deployment["spec"]["replicas"] == 2


async def test_start_replica_checks_the_node(world: KubeWorld, provider: KubernetesProvider) -> None:
    add_node(world, "gpu-down", gpus=8, ready=False)
    with pytest.raises(NotFound):
        await provider.start_replica("no-such-node", SPEC)
    with pytest.raises(NodeNotReady):
        await provider.start_replica("gpu-down", SPEC)
    node = await provider.create(claim())
    with pytest.raises(NodeNotReady):
        await provider.start_replica(node.id, SPEC)  # still booting
    world.set_node_pool(status={"readyReplicas": 1})
    handle = await provider.start_replica(node.id, SPEC)
    assert handle.state is ReplicaState.STARTING and handle.id.startswith("llama-8b-")
    assert await provider.list_replicas() != []


# --------------------------------------------------------------------------------------------- nodes


async def test_gpu_nodes_match_the_selector_and_report_gpus(world: KubeWorld, provider: KubernetesProvider) -> None:
    add_node(world, "gpu-b", gpus=4)
    add_node(world, "cpu-only", gpus=0)
    add_node(world, "h100", gpus=8, labels={"gpu.nvidia.com/class": "H100_NVLINK_80GB"})
    nodes = await provider.gpu_nodes()
    assert [(n.name, n.gpu_capacity, n.gpu_allocatable, n.ready) for n in nodes] == [
        ("gpu-a", 8, 8, True), ("gpu-b", 4, 4, True)]


async def test_create_and_delete_resize_the_node_pool(world: KubeWorld, provider: KubernetesProvider) -> None:
    world.set_node_pool(spec={"replicas": 2}, status={"readyReplicas": 2})  # two machines not kvgate's
    first, second = claim(), claim()
    node = await provider.create(first)
    assert (await provider.create(first)).id == node.id
    await provider.create(second)
    pool = world.node_pool()
    assert pool["spec"]["replicas"] == 4
    assert set(json.loads(pool["metadata"]["annotations"][ANNOTATION_CLAIMS])["prod"]) == {first.id, second.id}
    assert {n.state for n in await provider.list()} == {NodeState.PENDING}
    world.set_node_pool(status={"readyReplicas": 3})  # the controller made one more machine: the older claim's
    states = {n.claim_id: n.state for n in await provider.list()}
    assert states == {first.id: NodeState.RUNNING, second.id: NodeState.PENDING}
    await provider.delete(node.id)
    await provider.delete(node.id)
    assert world.node_pool()["spec"]["replicas"] == 3
    assert [n.claim_id for n in await provider.list()] == [second.id]


async def test_the_pool_quota_and_budget_limit_the_node_pool(world: KubeWorld) -> None:
    provider = KubernetesProvider(POOL, pool_spec(world.kubeconfig, max_gpus=16), cluster="prod", clock=FakeClock())
    try:
        await provider.create(claim())
        await provider.create(claim())
        with pytest.raises(QuotaExceeded, match="max_gpus"):
            await provider.create(claim())  # three nodes of 8 GPUs
        assert world.node_pool()["spec"]["replicas"] == 2
    finally:
        await provider.close()
    # Two nodes at $17.60/h spend $35.20/h; a third would pass a $50/h budget.
    provider = KubernetesProvider(POOL, pool_spec(world.kubeconfig, budget_usd_per_hour=50.0), cluster="prod",
                                  clock=FakeClock())
    try:
        with pytest.raises(QuotaExceeded, match="budget"):
            await provider.create(claim())
        assert world.node_pool()["spec"]["replicas"] == 2
    finally:
        await provider.close()


async def test_a_pool_without_node_pool_cannot_buy(world: KubeWorld) -> None:
    provider = KubernetesProvider(POOL, pool_spec(world.kubeconfig, node_pool=None), cluster="prod", clock=FakeClock())
    try:
        assert [o.available for o in await provider.offerings()] == [False]
        with pytest.raises(InsufficientCapacity, match="node_pool"):
            await provider.create(claim())
        assert await provider.list() == []
        await provider.start_replica("gpu-a", SPEC, replica_id="r-1")  # replicas still run on the cluster's nodes
        assert [h.id for h in await provider.list_replicas()] == ["r-1"]
    finally:
        await provider.close()


# -------------------------------------------------------------------------------------------- errors


async def test_api_errors_are_typed(world: KubeWorld, provider: KubernetesProvider) -> None:
    world.emulator["get /api/v1/nodes"] << 503
    with pytest.raises(ProviderUnavailable):
        await provider.gpu_nodes()
    assert provider._sleep == [0.5, 1.0, 2.0]  # four tries, three waits
    world.emulator["get /apis/apps/v1/namespaces/kvgate-test/deployments"] << 403
    with pytest.raises(ProviderError, match="RBAC") as raised:
        await provider.list_replicas()
    assert not raised.value.retryable


def test_a_bad_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ProviderError, match="kubeconfig"):
        KubernetesProvider(POOL, pool_spec(tmp_path / "missing.yaml"), cluster="prod", clock=FakeClock())
    with pytest.raises(ProviderError, match="GROUP/VERSION/PLURAL/NAME"):
        KubernetesProvider(POOL, pool_spec(tmp_path / "missing.yaml", node_pool="a/b"), cluster="prod",
                           clock=FakeClock())


# ---------------------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("spec", [
    SPEC,
    ReplicaSpec(model="tiny", source="builtin:tiny-llama"),  # CPU: no GPU limits, no tolerations
    ReplicaSpec(model="m" * 63, source="/models/x", gpu_count=8, adapters=(("sql", "s3://b/sql"),), dtype="bfloat16"),
])
def test_generated_deployments_are_valid(spec: ReplicaSpec) -> None:
    settings = DeploymentSettings(namespace="ml", image="registry.example/kvgate:1.0", node_selector={})
    manifest = valid(deployment_manifest(spec, cluster="A Cluster/With:odd chars", pool="p" * 63,
                                         settings=settings, replica_ids=["a", "b", "c"]))
    assert len(manifest["metadata"]["name"]) <= 63 and manifest["spec"]["replicas"] == 3
    pod = manifest["spec"]["template"]["spec"]
    assert ("tolerations" in pod) == bool(spec.gpu_count)
    assert ("resources" in pod["containers"][0]) == bool(spec.gpu_count)


def test_names_and_label_values_stay_within_kubernetes_limits() -> None:
    assert label_value("prod") == "prod"
    odd = label_value("team a/prod:1")
    assert len(odd) <= 63 and odd != label_value("team a/prod:2")
    assert object_name("kvgate", "prod", "llama", "cw") == "kvgate-prod-llama-cw"
    assert len(object_name("kvgate", "x" * 80)) == 63
    assert NodePoolRef.parse("gpu") == NodePoolRef("cluster.x-k8s.io", "v1beta1", "machinedeployments", "gpu")
    assert str(NodePoolRef.parse("cluster.x-k8s.io/v1beta1/machinepools/mp")) == "cluster.x-k8s.io/v1beta1/machinepools/mp"


@pytest.mark.parametrize("pod,expected", [
    ({"status": {"phase": "Pending"}}, ReplicaState.STARTING),
    ({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}, ReplicaState.READY),
    ({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}}, ReplicaState.STARTING),
    ({"status": {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"}}, ReplicaState.FAILED),
    ({"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]}},
     ReplicaState.FAILED),
    ({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {"phase": "Running"}}, ReplicaState.STOPPED),
])
def test_pod_states_map_to_replica_states(pod: dict, expected: ReplicaState) -> None:
    state, reason = pod_replica_state(pod)
    assert state is expected
    assert bool(reason) == (expected is ReplicaState.FAILED)


async def test_build_provider_makes_a_kubernetes_provider(world: KubeWorld) -> None:
    from kvgate.providers.build import build_provider
    provider = build_provider(POOL, pool_spec(world.kubeconfig), cluster="c", clock=FakeClock())
    try:
        assert isinstance(provider, KubernetesProvider) and provider.namespace == NAMESPACE
        assert [n.name for n in await provider.gpu_nodes()] == ["gpu-a"]
    finally:
        await provider.close()


TEMPLATE = parse_engine_pod_template({"spec": {
    "imagePullSecrets": [{"name": "registry-creds"}],
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
    "containers": [{"name": "engine", "image": "registry.example/kvgate:cuda",
                    "resources": {"requests": {"memory": "64Gi"}}}]}}, "template.yaml")


async def test_build_provider_hands_the_engine_pod_template_to_kubernetes_pools(world: KubeWorld) -> None:
    from kvgate.providers.build import build_provider
    spec = pool_spec(world.kubeconfig, kubernetes={"namespace": NAMESPACE, "kubeconfig": str(world.kubeconfig),
                                                   "node_selector": GPU_LABELS})
    provider = build_provider(POOL, spec, cluster="prod", clock=FakeClock(), engine_pod_template=TEMPLATE)
    try:
        await provider.start_replica("gpu-a", SPEC, replica_id="r-1")
    finally:
        await provider.close()
    pod = valid(stored(world, DEPLOYMENTS, object_name("kvgate", "prod", "llama-8b", POOL)))["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["containers"][0]["image"] == "registry.example/kvgate:cuda"  # the pool names no image
    assert pod["containers"][0]["resources"]["requests"] == {"memory": "64Gi", "nvidia.com/gpu": "1"}
    assert pod["nodeSelector"] == GPU_LABELS


def test_build_provider_leaves_the_engine_pod_template_to_pods() -> None:
    from kvgate.providers.build import build_provider
    from kvgate.providers.fake import FakeProvider
    spec = PoolSpec.model_validate({"provider": "fake", "offers": [
        {"instance_type": "x", "gpu_kind": "L4", "gpu_count": 1, "price_usd_per_hour": 1.0}]})
    provider = build_provider("fake-pool", spec, cluster="c", clock=FakeClock(), engine_pod_template=TEMPLATE)
    assert isinstance(provider, FakeProvider)
