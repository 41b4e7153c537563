"""One active autoscaler: two loops on one state store (the memory store, and a real redis-server),
one cloud. The standby does nothing until the leader stops (releases the lease) or dies (its lease
expires ttl after the last renewal); the new leader adopts the fleet instead of buying it again.

Also the crash tests at loop level: the leader is killed inside a tick between "claim written" and
"provider called", and between "provider called" and "claim confirmed"; the standby takes over and
afterwards every claim was bought exactly once and no node is untracked.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from kvgate.autoscaler.claims import ClaimPhase, ClaimStore
from kvgate.autoscaler.reconciler import CLAIM_WRITTEN, PROVIDER_CALLED
from kvgate.clock import FakeClock
from kvgate.state import StateStore
from kvgate.providers.fake import FakeCloud, FakeProvider
from tests.autoscaler.fleet_helpers import Killed, kill_at, load_test_registry, make_autoscaler, observe, open_store
from tests.eventually import eventually




@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
async def two_stores(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[tuple[StateStore, StateStore]]:
    """Two clients of one store: the same object for memory, two connections to one redis prefix."""
    async with AsyncExitStack() as stack:
        if request.param == "memory":
            shared = await stack.enter_async_context(open_store("memory", clock))
            yield shared, shared
        else:
            url, prefix = request.getfixturevalue("redis_url"), f"test-{uuid.uuid4().hex[:12]}:"
            first = await stack.enter_async_context(open_store("redis", clock, url, prefix))
            second = await stack.enter_async_context(open_store("redis", clock, url, prefix))
            yield first, second


@pytest.fixture
def snapshot(tmp_path: Path):
    return load_test_registry(tmp_path)


def pair(snapshot, stores, clock: FakeClock, hook=None):
    """Leader-to-be "a" and standby "b": separate providers (separate processes) on one cloud."""
    cloud = FakeCloud()
    providers = [FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, cloud=cloud)
                 for _ in range(2)]
    a = make_autoscaler(snapshot, stores[0], clock, providers[0], holder="a", fault_hook=hook)
    b = make_autoscaler(snapshot, stores[1], clock, providers[1], holder="b")
    return a, b, providers


async def both_tick(a, b, clock: FakeClock, store: StateStore, seconds: int, queued: int = 5) -> None:
    for _ in range(seconds):
        await observe(store, clock, queued=queued)
        await a.tick()
        await b.tick()
        await clock.advance(1)


async def test_only_the_lease_holder_acts(snapshot, two_stores, clock: FakeClock) -> None:
    a, b, (pa, pb) = pair(snapshot, two_stores, clock)
    await both_tick(a, b, clock, two_stores[0], 8)

    assert a.is_leader and not b.is_leader
    assert pb.calls == []  # the standby never touched the cloud
    assert len(await pa.list()) == 2  # 5 queued / target 4 -> 2 replicas, one L4 node each
    assert await two_stores[1].lease_holder("autoscaler") == "a"


async def test_a_stopped_leader_hands_over_at_once_and_the_fleet_is_adopted(snapshot, two_stores, clock) -> None:
    a, b, (pa, pb) = pair(snapshot, two_stores, clock)
    await both_tick(a, b, clock, two_stores[0], 8)
    before = sorted(n.id for n in await pa.list())

    await a.stop()  # SIGTERM: the lease is released, nodes stay
    report = await b.tick()

    assert report.leader and b.is_leader
    assert sorted(n.id for n in await pb.list()) == before
    await both_tick(a, b, clock, two_stores[0], 5)
    assert [args for name, args in pb.calls if name in ("create", "delete", "stop_replica")] == []
    status = (await two_stores[1].get_record("autoscaler", "status")).data
    assert status["holder"] == "b" and status["models"]["m"]["ready"] == 2


async def test_a_dead_leader_is_replaced_once_its_lease_expires(snapshot, two_stores, clock) -> None:
    a, b, (pa, pb) = pair(snapshot, two_stores, clock)
    await both_tick(a, b, clock, two_stores[0], 3)
    standby_ticks = 0
    while not (await b.tick()).leader:  # "a" died: it neither ticks nor releases
        standby_ticks += 1
        await clock.advance(1)
    # a renewed at t=2 with ttl 10 s; b's ticks at t=3..11 see it live, t=12 takes over
    assert standby_ticks == 9


@pytest.mark.parametrize("point", [CLAIM_WRITTEN, PROVIDER_CALLED])
async def test_a_leader_killed_mid_purchase_leaves_no_leak_and_no_double_buy(
        snapshot, two_stores, clock, point: str) -> None:
    a, b, (pa, pb) = pair(snapshot, two_stores, clock, hook=kill_at(point))
    await observe(two_stores[0], clock, queued=5)
    with pytest.raises(Killed):
        await a.tick()  # the process dies inside its first purchase
    while not (await b.tick()).leader:
        await clock.advance(1)
    for _ in range(6):
        await observe(two_stores[1], clock, queued=5)
        await b.tick()
        await clock.advance(1)

    nodes = await pb.list()
    claims = await ClaimStore(two_stores[1], "check").list()
    creates_by_a = [args[0].id for name, args in pa.calls if name == "create"]
    creates_by_b = [args[0].id for name, args in pb.calls if name == "create"]
    [killed] = [c.claim_id for c in claims if c.claim_id.startswith(a.id_prefix)]
    if point == CLAIM_WRITTEN:  # a died before calling the provider: b re-drove the pending claim
        assert creates_by_a == [] and creates_by_b.count(killed) == 1
    else:  # a's create went through: b adopted the node and never asked again
        assert creates_by_a == [killed] and killed not in creates_by_b
    assert len(nodes) == 2  # 5 queued / target 4 -> 2 replicas, one node each
    assert sorted(n.claim_id for n in nodes) == sorted(c.claim_id for c in claims)  # every node tracked
    assert all(c.phase is ClaimPhase.CONFIRMED for c in claims)
    every_create = creates_by_a + creates_by_b
    assert sorted(set(every_create)) == sorted(every_create)  # no claim id bought twice


class SlowFirstCreateProvider(FakeProvider):
    """A cloud whose first create takes 11 s: longer than the 10 s lease."""

    async def create(self, claim):
        if not any(name == "create" for name, _ in self.calls):
            await self._clock.sleep(11)
        return await super().create(claim)


async def test_a_leader_whose_lease_lapsed_mid_tick_stops_buying(snapshot, two_stores, clock) -> None:
    cloud = FakeCloud()
    slow = SlowFirstCreateProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, cloud=cloud)
    other = FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, cloud=cloud)
    a = make_autoscaler(snapshot, two_stores[0], clock, slow, holder="a")
    b = make_autoscaler(snapshot, two_stores[1], clock, other, holder="b")
    await observe(two_stores[0], clock, queued=9)  # ceil(9 / 4) = 3 replicas: three CreateNode actions
    tick_a = asyncio.create_task(a.tick())
    await eventually(lambda: clock.num_sleepers, "a sits in its first create")  # redis round trips take real time
    await clock.advance(10.5)  # a is inside its first create; its lease lapsed at +10 s
    other.fail_next(1, methods=["list"])  # b leads but cannot see the pool, so it leaves a's claim alone
    assert (await b.tick()).leader
    await clock.advance(1)  # a's create returns; before buying more, a must notice it lost the lease
    await tick_a

    creates_by_a = [args[0].id for name, args in slow.calls if name == "create"]
    assert len(creates_by_a) == 1  # without the mid-tick renewal a would go on to buy all three
    [node] = await other.list()
    [record] = await ClaimStore(two_stores[1], "check").list()
    assert (record.claim_id, record.node_id) == (node.claim_id, node.id)  # the one node is tracked
