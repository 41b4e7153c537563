"""Shared set-up for the reconciler and loop suites: a fake cloud, a state store, a tiny registry.

The providers fake (`providers.fake.FakeProvider`) is the stand-in for a cloud: in memory, driven by
the fake clock, with a call log. The state stores are the real ones (memory, and redis against a real
redis-server where a test asks for it).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvgate.clock import FakeClock
from kvgate.state import MemoryStateStore, RedisStateStore, StateStore
from providers.base import CapacityType, NodeClaim, OfferingKey
from providers.fake import FakeCloud, FakeProvider
from registry.schema import PoolSpec

CLUSTER = "test"
POOL = "gpu"
L4 = OfferingKey(POOL, "g6.xlarge", CapacityType.ON_DEMAND)
L4_SPOT = OfferingKey(POOL, "g6.xlarge", CapacityType.SPOT)


class Killed(BaseException):
    """Simulated process death at a fault point. A BaseException, like KeyboardInterrupt, so no
    `except Exception` in the code under test can swallow it: the "process" really stops there."""


def kill_at(point: str):
    """A fault hook that kills the caller the first time it reaches `point`."""
    fired: list[str] = []

    def hook(where: str, claim_id: str) -> None:
        if where == point and not fired:
            fired.append(claim_id)
            raise Killed(f"killed at {point} of {claim_id}")
    return hook


def pool_spec(**overrides) -> PoolSpec:
    spec = {"provider": "fake", "node_boot_s": 0, "offers": [
        {"instance_type": "g6.xlarge", "gpu_kind": "L4", "gpu_count": 1, "gpu_memory_gib": 24,
         "capacity_type": "on_demand", "price_usd_per_hour": 0.80},
        {"instance_type": "g6.xlarge", "gpu_kind": "L4", "gpu_count": 1, "gpu_memory_gib": 24,
         "capacity_type": "spot", "price_usd_per_hour": 0.35},
    ]}
    spec.update(overrides)
    return PoolSpec.model_validate(spec)


def fake_provider(clock: FakeClock, cloud: FakeCloud | None = None, *, cluster: str = CLUSTER,
                  **options) -> FakeProvider:
    return FakeProvider(POOL, pool_spec(), cluster=cluster, clock=clock, cloud=cloud or FakeCloud(), **options)


def claim(claim_id: str, offering: OfferingKey = L4, model: str | None = "m") -> NodeClaim:
    return NodeClaim(id=claim_id, offering=offering, model=model)


def creates(provider: FakeProvider) -> list[str]:
    """Claim ids passed to `create`, in call order (failed calls included)."""
    return [args[0].id for method, args in provider.calls if method == "create"]


@asynccontextmanager
async def open_store(kind: str, clock: FakeClock, redis_url: str | None = None,
                     prefix: str | None = None) -> AsyncIterator[StateStore]:
    """A fresh store of `kind` ("memory" or "redis"); the redis one gets a key prefix of its own
    unless `prefix` is given (two clients of one store share a prefix)."""
    if kind == "memory":
        store: StateStore = MemoryStateStore(clock)
    else:
        assert redis_url is not None
        store = RedisStateStore.from_url(redis_url, clock, prefix=prefix or f"test-{uuid.uuid4().hex[:12]}:")
    try:
        yield store
    finally:
        await store.close()
