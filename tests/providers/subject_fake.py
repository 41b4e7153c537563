"""The contract subject for FakeProvider: two clusters on one FakeCloud, driven by a FakeClock."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvgate.clock import FakeClock
from kvgate.providers.base import CapacityType, InsufficientCapacity, NodeClaim, OfferingKey, ProviderError
from kvgate.providers.fake import FakeCloud, FakeProvider
from kvgate.registry.schema import PoolSpec
from tests.providers.contract import ContractSubject

POOL = "fake-pool"
SPEC = PoolSpec.model_validate({
    "provider": "fake", "region": "us-test-1", "node_boot_s": 0,
    "offers": [
        {"instance_type": "g6.xlarge", "gpu_kind": "L4", "gpu_count": 1, "gpu_memory_gib": 24,
         "price_usd_per_hour": 0.8, "capacity_type": "on_demand"},
        {"instance_type": "g6.xlarge", "gpu_kind": "L4", "gpu_count": 1, "gpu_memory_gib": 24,
         "price_usd_per_hour": 0.3, "capacity_type": "spot", "zones": ["us-test-1a", "us-test-1b"]},
    ],
})


def claim(instance_type: str = "g6.xlarge", capacity_type: CapacityType = CapacityType.ON_DEMAND,
          zone: str = "") -> NodeClaim:
    return NodeClaim(id=f"claim-{uuid.uuid4().hex[:10]}", offering=OfferingKey(POOL, instance_type, capacity_type, zone),
                     model="tiny-llama")


@asynccontextmanager
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]:
    clock, cloud = FakeClock(), FakeCloud()
    provider = FakeProvider(POOL, SPEC, cluster=f"a-{uuid.uuid4().hex[:6]}", clock=clock, cloud=cloud)
    other = FakeProvider(POOL, SPEC, cluster=f"b-{uuid.uuid4().hex[:6]}", clock=clock, cloud=cloud)

    async def exhaust() -> tuple[NodeClaim, type[ProviderError]]:
        provider.set_stockout("g6.xlarge", CapacityType.SPOT, "us-test-1b")
        return claim(capacity_type=CapacityType.SPOT, zone="us-test-1b"), InsufficientCapacity

    yield ContractSubject(provider=provider, other_cluster=other, new_claim=claim, exhaust=exhaust)
    await provider.close()
    await other.close()
