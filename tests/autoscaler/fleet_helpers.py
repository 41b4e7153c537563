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
from kvgate.providers.base import CapacityType, NodeClaim, OfferingKey
from kvgate.providers.fake import FakeCloud, FakeProvider
from kvgate.registry.schema import PoolSpec

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


MODEL_YAML = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: m}}
spec:
  source: builtin:tiny-llama
  resources: {{gpu_kinds: [L4], gpu_count: 1}}
  scaling:
    min_replicas: {min_replicas}
    max_replicas: 4
    target_ongoing_requests: 4
    stable_window_s: 20
    max_queue_wait_s: 60
    scale_down_delay_s: 0
    scale_to_zero_grace_s: 30
    forecast_enabled: false
  placement: {{pools: [gpu], allow_spot: {allow_spot}}}
  performance: {{model_load_s: 5{gpu_performance}}}{slo}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: gpu}}
spec:
  provider: fake
  node_boot_s: {node_boot_s}
  offers:
    - {{instance_type: g6.xlarge, gpu_kind: L4, gpu_count: 1, gpu_memory_gib: 24, capacity_type: on_demand,
       price_usd_per_hour: 0.80}}
    - {{instance_type: g6.xlarge, gpu_kind: L4, gpu_count: 1, gpu_memory_gib: 24, capacity_type: spot,
       price_usd_per_hour: 0.35}}
"""


# `work=True`: the model declares a TTFT SLO and L4 figures, so the scaler sizes it on work (autoscaler/work.py).
WORK = (", gpu_kinds: [{gpu_kind: L4, prefill_tokens_per_s: 4000, decode_tokens_per_s: 400, max_batch: 8}]",
        "\n  slo: {ttft_ms: 2000}")


def write_registry(directory, *, min_replicas: int = 0, node_boot_s: float = 0, allow_spot: bool = False,
                   work: bool = False):
    """A registry with one GPU model `m` (target 4 ongoing per replica, 0..4 replicas, stable window
    20 s) on pool `gpu`."""
    gpu_performance, slo = WORK if work else ("", "")
    (directory / "registry.yaml").write_text(MODEL_YAML.format(
        min_replicas=min_replicas, node_boot_s=node_boot_s, allow_spot=str(allow_spot).lower(),
        gpu_performance=gpu_performance, slo=slo))
    return directory


def load_test_registry(directory, **options):
    from kvgate.registry import load_registry

    return load_registry(write_registry(directory, **options))


async def observe(store: StateStore, clock: FakeClock, *, queued: int = 0, in_flight: int = 0,
                  arrivals_per_s: float = 0.0, model: str = "m", gateway: str = "g1", **work: float) -> None:
    """Write one gateway's observation record, as a router gateway does every second (`work`: its
    prompt_tokens_per_s, prompt_tokens_sq_per_s and arrivals_var)."""
    await store.put_record("observations", f"{model}@{gateway}", {
        "model": model, "gateway_id": gateway, "queued": queued, "in_flight": in_flight,
        "arrivals_per_s": arrivals_per_s, "ttft_p99_s": None, "updated_at": clock.wall(), **work})


def make_autoscaler(snapshot, store: StateStore, clock: FakeClock, provider: FakeProvider, *,
                    holder: str = "a", fault_hook=None, **settings):
    """An Autoscaler over one fake pool, 1 s ticks, short planner graces so tests stay small."""
    from kvgate.autoscaler.loop import Autoscaler, AutoscalerSettings, FixedSnapshot
    from kvgate.autoscaler.planner import PlannerSettings

    planner = settings.pop("planner", PlannerSettings(empty_node_grace_s=5.0, consolidation_enabled=False))
    return Autoscaler(FixedSnapshot(snapshot), store, clock, providers={POOL: provider}, holder=holder,
                      fault_hook=fault_hook, settings=AutoscalerSettings(planner=planner, **settings))


async def members(store: StateStore) -> list[tuple[str, str]]:
    return [(m.replica_id, m.state.value) for m in await store.list_members()]
