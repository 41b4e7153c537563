"""The contract subject for KubernetesProvider: two clusters on one `kmock` Kubernetes API emulator,
served over real HTTP on a loopback port and reached by the official client through a kubeconfig file.

kmock stores objects and applies merge patches, but has no controllers and ignores label selectors:
nothing turns a node pool's `spec.replicas` into machines or a Deployment into pods. So created nodes
stay PENDING (the contract allows it), and `exhaust()` plays "someone else scaled the node pool to the
pool's max_nodes" by writing the object, after which `create` must raise QuotaExceeded.
`kube_world` is also used by test_kubernetes.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from kvgate.clock import FakeClock
from kvgate.providers.base import CapacityType, NodeClaim, OfferingKey, ProviderError, QuotaExceeded
from kvgate.providers.kubernetes import KubernetesProvider
from kvgate.registry.schema import PoolSpec
from tests.providers.contract import ContractSubject

POOL = "cw-pool"
NAMESPACE = "kvgate-test"
NODE_POOL = "gpu-workers"
MACHINE_DEPLOYMENTS = "cluster.x-k8s.io/v1beta1/machinedeployments"
MAX_NODES = 8


@dataclass
class KubeWorld:
    emulator: kmock.KubernetesEmulator
    kubeconfig: Path

    def node_pool(self) -> dict[str, Any]:
        return self.emulator.objects[MACHINE_DEPLOYMENTS, NAMESPACE, NODE_POOL].raw

    def set_node_pool(self, **spec_or_status: Any) -> None:
        """Write the node pool as its controller (or another operator) would."""
        self.emulator.objects[MACHINE_DEPLOYMENTS, NAMESPACE, NODE_POOL].patch(spec_or_status)


@asynccontextmanager
async def kube_world(work_dir: Path) -> AsyncIterator[KubeWorld]:
    """kmock on a free loopback port with a MachineDeployment `gpu-workers` (0 replicas), and a
    kubeconfig file that points the official client at it."""
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        # The built-in kinds the provider uses, so that listing an empty kind answers an empty list, as
        # a real API server does, rather than 404.
        for resource, kind, namespaced in (("apps/v1/deployments", "Deployment", True), ("v1/pods", "Pod", True),
                                           ("v1/nodes", "Node", False)):
            emulator.resources[resource] = {"kind": kind, "namespaced": namespaced}
        emulator.objects[MACHINE_DEPLOYMENTS, NAMESPACE, NODE_POOL] = {
            "apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment",
            "metadata": {"name": NODE_POOL, "namespace": NAMESPACE},
            "spec": {"clusterName": "coreweave-test", "replicas": 0}, "status": {"readyReplicas": 0}}
        kubeconfig = work_dir / "kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": str(server.url).rstrip("/")}}],
            "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester", "namespace": NAMESPACE}}],
        }))
        yield KubeWorld(emulator, kubeconfig)


def pool_spec(kubeconfig: Path, *, node_pool: str | None = NODE_POOL, **extra: Any) -> PoolSpec:
    return PoolSpec.model_validate({
        "provider": "kubernetes", "max_nodes": MAX_NODES,
        "kubernetes": {"namespace": NAMESPACE, "kubeconfig": str(kubeconfig), "context": "kmock",
                       "image": "ghcr.io/kvgate/kvgate:test", "node_pool": node_pool,
                       "node_selector": {"gpu.nvidia.com/class": "A100_NVLINK_80GB"}},
        "offers": [{"instance_type": "gd-8xa100-i128", "gpu_kind": "A100-80GB", "gpu_count": 8,
                    "gpu_memory_gib": 80, "price_usd_per_hour": 17.6}],
        **extra})


def claim(model: str = "tiny-llama") -> NodeClaim:
    return NodeClaim(id=f"claim-{uuid.uuid4().hex[:10]}", model=model,
                     offering=OfferingKey(POOL, "gd-8xa100-i128", CapacityType.ON_DEMAND))


async def no_sleep(seconds: float) -> None:
    """Retry waits are the injected sleep's business; the contract needs none."""


@asynccontextmanager
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]:
    async with kube_world(request.getfixturevalue("tmp_path")) as world:
        spec = pool_spec(world.kubeconfig)
        clock = FakeClock()
        provider = KubernetesProvider(POOL, spec, cluster=f"a-{uuid.uuid4().hex[:6]}", clock=clock, sleep=no_sleep)
        other = KubernetesProvider(POOL, spec, cluster=f"b-{uuid.uuid4().hex[:6]}", clock=clock, sleep=no_sleep)

        async def exhaust() -> tuple[NodeClaim, type[ProviderError]]:
            world.set_node_pool(spec={"replicas": MAX_NODES})
            return claim(), QuotaExceeded

        try:
            # A node pool has no per-offering stockout to flag: it only hits the pool's quota.
            yield ContractSubject(provider=provider, other_cluster=other, new_claim=claim, exhaust=exhaust,
                                  flags_stockouts=False)
        finally:
            await provider.close()
            await other.close()
