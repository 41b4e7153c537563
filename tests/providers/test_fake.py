"""FakeProvider's own behaviour: time from a FakeClock, fault injection and the call record, which the
autoscaler tests and the simulator rely on. (The contract it shares with every provider is in
test_contract.py.)"""

from __future__ import annotations

import pytest

from kvgate.clock import FakeClock
from kvgate.providers.base import (CapacityType, InsufficientCapacity, NodeNotReady, NodeState, ProviderUnavailable,
                            QuotaExceeded, ReplicaSpec, ReplicaState)
from kvgate.providers.build import build_provider
from kvgate.providers.fake import FakeCloud, FakeProvider
from tests.providers.subject_fake import POOL, SPEC, claim

SPEC_BOOTING = SPEC.model_copy(update={"node_boot_s": 90.0})
TINY = ReplicaSpec(model="tiny-llama", source="builtin:tiny-llama")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake(clock: FakeClock) -> FakeProvider:
    return FakeProvider(POOL, SPEC_BOOTING, cluster="c1", clock=clock)


async def test_build_provider_picks_the_fake(clock: FakeClock) -> None:
    cloud = FakeCloud()
    provider = build_provider(POOL, SPEC, cluster="c1", clock=clock, cloud=cloud)
    assert isinstance(provider, FakeProvider) and provider.cloud is cloud


async def test_a_node_is_pending_until_the_boot_time_passes(fake: FakeProvider, clock: FakeClock) -> None:
    node = await fake.create(claim())
    assert node.state is NodeState.PENDING
    assert node.launched_at == clock.wall()
    with pytest.raises(NodeNotReady):
        await fake.start_replica(node.id, TINY)
    await clock.advance(89.9)
    assert [n.state for n in await fake.list()] == [NodeState.PENDING]
    await clock.advance(0.1)
    assert [n.state for n in await fake.list()] == [NodeState.RUNNING]
    fake.launch_latency_s = 5.0  # settable: applies to nodes bought from now on
    later = await fake.create(claim())
    await clock.advance(5.0)
    assert {n.id: n.state for n in await fake.list()}[later.id] is NodeState.RUNNING


async def test_replicas_start_after_their_latency_or_fail_with_a_reason(fake: FakeProvider, clock: FakeClock) -> None:
    fake.launch_latency_s = 0.0
    fake.replica_start_latency_s = 20.0
    node = await fake.create(claim())
    good = await fake.start_replica(node.id, TINY, replica_id="r-good")
    fake.fail_next_replicas(1, reason="CUDA out of memory")
    bad = await fake.start_replica(node.id, TINY)
    assert good.state is bad.state is ReplicaState.STARTING
    assert good.url.startswith(f"http://{node.address}:")
    assert (await fake.start_replica(node.id, TINY, replica_id="r-good")).id == "r-good"  # idempotent
    await clock.advance(20.0)
    states = {r.id: (r.state, r.reason) for r in await fake.list_replicas()}
    assert states == {"r-good": (ReplicaState.READY, ""), bad.id: (ReplicaState.FAILED, "CUDA out of memory")}
    await fake.stop_replica(bad.id, drain_deadline_s=0)
    assert [r.id for r in await fake.list_replicas()] == ["r-good"]


async def test_preemption_interrupts_the_node_and_fails_its_replicas(fake: FakeProvider, clock: FakeClock) -> None:
    fake.launch_latency_s = 0.0
    spot = claim(capacity_type=CapacityType.SPOT, zone="us-test-1a")
    node = await fake.create(spot)
    assert node.capacity_type is CapacityType.SPOT and node.zone == "us-test-1a"
    replica = await fake.start_replica(node.id, TINY)
    fake.preempt(node.id)
    [listed] = await fake.list()
    assert listed.state is NodeState.INTERRUPTED and "spot" in listed.reason
    [failed] = await fake.list_replicas()
    assert failed.id == replica.id and failed.state is ReplicaState.FAILED and node.id in failed.reason
    await fake.delete(node.id)
    assert await fake.list() == [] and await fake.list_replicas() == []


async def test_stockouts_flag_offerings_and_raise(fake: FakeProvider) -> None:
    fake.set_stockout("g6.xlarge", CapacityType.SPOT)
    offerings = {str(o.key): o.available for o in await fake.offerings()}
    assert offerings == {"fake-pool:g6.xlarge:on_demand": True, "fake-pool:g6.xlarge:spot/us-test-1a": False,
                         "fake-pool:g6.xlarge:spot/us-test-1b": False}
    wanted = claim(capacity_type=CapacityType.SPOT)  # any zone: both sold out
    with pytest.raises(InsufficientCapacity) as raised:
        await fake.create(wanted)
    assert raised.value.offering == wanted.offering
    fake.clear_stockout("g6.xlarge", CapacityType.SPOT, "us-test-1b")
    node = await fake.create(wanted)
    assert node.zone == "us-test-1b", "an any-zone claim lands in a zone in stock"


async def test_quota_on_nodes_gpus_and_budget(clock: FakeClock) -> None:
    limited = SPEC.model_copy(update={"max_nodes": 2})
    fake = FakeProvider(POOL, limited, cluster="c1", clock=clock)
    await fake.create(claim())
    await fake.create(claim())
    with pytest.raises(QuotaExceeded, match="2 nodes"):
        await fake.create(claim())
    fake.set_quota(max_gpus=2)
    with pytest.raises(QuotaExceeded, match="GPUs"):
        await fake.create(claim())
    fake.set_quota(budget_usd_per_hour=2.0)  # two on-demand nodes at $0.80 spend $1.60
    with pytest.raises(QuotaExceeded, match="budget"):
        await fake.create(claim())
    await fake.create(claim(capacity_type=CapacityType.SPOT))  # $0.30 more fits: $1.90
    assert len(await fake.list()) == 3


async def test_injected_api_errors_are_retryable_and_counted(fake: FakeProvider) -> None:
    fake.fail_next(2, methods=["create"])
    await fake.list()  # other methods are not affected
    wanted = claim()
    for _ in range(2):
        with pytest.raises(ProviderUnavailable) as raised:
            await fake.create(wanted)
        assert raised.value.retryable
    node = await fake.create(wanted)
    assert [n.id for n in await fake.list()] == [node.id]
    assert [name for name, _ in fake.calls] == ["list", "create", "create", "create", "list"]
    assert fake.calls[1] == ("create", (wanted,))


async def test_terminating_nodes_are_listed_until_gone(fake: FakeProvider, clock: FakeClock) -> None:
    fake.terminate_latency_s = 30.0
    node = await fake.create(claim())
    await fake.delete(node.id)
    assert [(n.id, n.state) for n in await fake.list()] == [(node.id, NodeState.TERMINATING)]
    await clock.advance(30.0)
    assert await fake.list() == []


async def test_the_same_script_gives_the_same_result(clock: FakeClock) -> None:
    async def script() -> list[tuple[str, str, str]]:
        fake = FakeProvider(POOL, SPEC, cluster="c1", clock=FakeClock())
        for index in range(3):
            node = await fake.create(claim())
            await fake.start_replica(node.id, TINY, replica_id=f"r{index}")
        return [(r.id, r.node_id, r.url) for r in await fake.list_replicas()]

    assert await script() == await script()
