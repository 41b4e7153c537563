"""The contract subject for LocalProvider: two clusters sharing one work dir of two slots.

The contract tests start no replica, so no engine process runs here (test_local.py starts real ones)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kvgate.clock import RealClock
from kvgate.providers.base import CapacityType, NodeClaim, OfferingKey, ProviderError, QuotaExceeded
from kvgate.providers.local import LocalProvider
from kvgate.registry.schema import PoolSpec

from tests.providers.contract import ContractSubject

POOL = "local-pool"
SLOTS = 2


def pool_spec(work_dir: Path, slots: int = SLOTS) -> PoolSpec:
    return PoolSpec.model_validate({
        "provider": "local", "max_nodes": slots, "local": {"work_dir": str(work_dir)},
        "offers": [{"instance_type": "this-machine", "gpu_kind": "cpu", "gpu_count": 0, "price_usd_per_hour": 0}],
    })


def claim() -> NodeClaim:
    return NodeClaim(id=f"claim-{uuid.uuid4().hex[:10]}",
                     offering=OfferingKey(POOL, "this-machine", CapacityType.ON_DEMAND), model="tiny-llama")


@asynccontextmanager
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]:
    spec = pool_spec(request.getfixturevalue("tmp_path") / "local")
    clock = RealClock()
    provider = LocalProvider(POOL, spec, cluster=f"a-{uuid.uuid4().hex[:6]}", clock=clock)
    other = LocalProvider(POOL, spec, cluster=f"b-{uuid.uuid4().hex[:6]}", clock=clock)

    async def exhaust() -> tuple[NodeClaim, type[ProviderError]]:
        # Slots are the pool's max_nodes quota, shared by every cluster on the machine: fill them all.
        while len(await provider.list()) + len(await other.list()) < SLOTS:
            await provider.create(claim())
        return claim(), QuotaExceeded

    try:
        yield ContractSubject(provider=provider, other_cluster=other, new_claim=claim, exhaust=exhaust)
    finally:
        for each in (provider, other):
            await each.stop_all(drain_deadline_s=1.0)
            await each.close()
