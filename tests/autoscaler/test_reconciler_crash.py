"""Crash-restart reconciliation: the loop is killed at each arrow of the claim protocol, a new
reconciler (a restarted process: new objects, same state store, same cloud) takes over, and
afterwards no node is leaked and no claim is bought twice.

Asserted on the providers fake's call log (`create` calls per claim id) and its node list. Every test
runs on the memory store and on a real redis-server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvgate.autoscaler.claims import ClaimPhase, ClaimStore
from kvgate.autoscaler.reconciler import (
    CLAIM_WRITTEN,
    DELETE_MARKED,
    NODE_DELETED,
    PROVIDER_CALLED,
    Reconciler,
)
from kvgate.clock import FakeClock
from kvgate.state import StateStore
from kvgate.providers.fake import FakeCloud
from tests.autoscaler.fleet_helpers import POOL, Killed, claim, creates, fake_provider, kill_at, open_store


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[StateStore]:
    redis_url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    async with open_store(request.param, clock, redis_url) as opened:
        yield opened


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def reconciler(provider, store: StateStore, clock: FakeClock, hook=None, holder: str = "first") -> Reconciler:
    return Reconciler({POOL: provider}, ClaimStore(store, holder), clock, fault_hook=hook)


async def test_killed_after_claim_written_restart_buys_it_exactly_once(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    with pytest.raises(Killed):
        await reconciler(provider, store, clock, kill_at(CLAIM_WRITTEN)).create_node(claim("c1"))
    assert creates(provider) == []  # died before the provider was called: nothing bought yet
    [pending] = await ClaimStore(store, "x").list()
    assert pending.phase is ClaimPhase.PENDING

    restarted = reconciler(provider, store, clock, holder="second")
    fleet = await restarted.reconcile()
    again = await restarted.reconcile()  # a second round changes nothing

    nodes = await provider.list()
    assert [n.claim_id for n in nodes] == ["c1"]
    assert creates(provider) == ["c1"]  # re-driven once, never twice
    assert fleet.claims["c1"].phase is ClaimPhase.CONFIRMED and fleet.claims["c1"].node_id == nodes[0].id
    assert [n.id for n in again.nodes] == [nodes[0].id]


async def test_killed_after_provider_called_restart_adopts_without_buying_again(
        store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    with pytest.raises(Killed):
        await reconciler(provider, store, clock, kill_at(PROVIDER_CALLED)).create_node(claim("c1"))
    [bought] = await provider.list()
    [pending] = await ClaimStore(store, "x").list()
    assert pending.phase is ClaimPhase.PENDING and pending.node_id is None  # the confirm never happened

    fleet = await reconciler(provider, store, clock, holder="second").reconcile()

    assert [n.id for n in await provider.list()] == [bought.id]  # not released, not bought again
    assert creates(provider) == ["c1"]
    assert fleet.claims["c1"].phase is ClaimPhase.CONFIRMED and fleet.claims["c1"].node_id == bought.id
    assert [e.kind.value for e in fleet.events] == ["node_adopted"]


async def test_killed_after_delete_marked_restart_finishes_the_delete(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    first = reconciler(provider, store, clock, kill_at(DELETE_MARKED))
    node = (await first.create_node(claim("c1"))).node
    with pytest.raises(Killed):
        await first.delete_node(node.id, await first.reconcile(), "empty")
    assert [n.id for n in await provider.list()] == [node.id]  # still there (and still paid for)

    fleet = await reconciler(provider, store, clock, holder="second").reconcile()

    assert await provider.list() == [] and fleet.nodes == ()
    assert await ClaimStore(store, "x").list() == []


async def test_killed_after_node_deleted_restart_removes_the_claim(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    first = reconciler(provider, store, clock, kill_at(NODE_DELETED))
    node = (await first.create_node(claim("c1"))).node
    with pytest.raises(Killed):
        await first.delete_node(node.id, await first.reconcile(), "empty")

    fleet = await reconciler(provider, store, clock, holder="second").reconcile()

    assert await provider.list() == [] and fleet.claims == {}
    assert creates(provider) == ["c1"]


async def test_a_tagged_node_without_a_claim_is_released_as_an_orphan(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    first = reconciler(provider, store, clock)
    await first.reconcile()  # the store keeps claims from here on (its ledger record is written)
    orphan = await provider.create(claim("nobody-wrote-this"))  # bought behind the claim store's back

    fleet = await first.reconcile()

    assert await provider.list() == []
    assert ("delete", (orphan.id,)) in provider.calls
    assert [e.kind.value for e in fleet.events] == ["orphan_released"]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_store_that_lost_every_claim_adopts_the_running_nodes_instead_of_releasing_them(
        kind: str, clock: FakeClock, request: pytest.FixtureRequest) -> None:
    # Redis restarted empty (no persistence), or the autoscaler was pointed at a new one: the claims are gone,
    # the nodes and their replicas are not. Releasing them as orphans would stop the whole serving fleet.
    # A store of a fresh key prefix is an emptied one.
    redis_url = request.getfixturevalue("redis_url") if kind == "redis" else None
    provider = fake_provider(clock)
    async with open_store(kind, clock, redis_url) as before:
        first = reconciler(provider, before, clock)
        await first.reconcile()
        bought = [(await first.create_node(claim(f"c{i}"))).node for i in (1, 2)]

    async with open_store(kind, clock, redis_url) as emptied:
        fleet = await reconciler(provider, emptied, clock, holder="second").reconcile()

        assert sorted(n.id for n in await provider.list()) == sorted(n.id for n in bought)  # none released
        assert [m for m, _ in provider.calls if m == "delete"] == []
        assert sorted(n.id for n in fleet.nodes) == sorted(n.id for n in bought)
        assert {c: (r.phase, r.node_id) for c, r in fleet.claims.items()} == {
            "c1": (ClaimPhase.CONFIRMED, bought[0].id), "c2": (ClaimPhase.CONFIRMED, bought[1].id)}
        assert [e.kind.value for e in fleet.events] == ["node_adopted", "node_adopted"]
        assert creates(provider) == ["c1", "c2"]  # nothing bought again

        # From then on the store keeps claims again: a node bought behind its back is an orphan once more.
        orphan = await provider.create(claim("nobody-wrote-this"))
        again = await reconciler(provider, emptied, clock, holder="second").reconcile()
        assert [e.kind.value for e in again.events] == ["orphan_released"]
        assert ("delete", (orphan.id,)) in provider.calls


async def test_another_clusters_nodes_are_never_touched(store: StateStore, clock: FakeClock) -> None:
    cloud = FakeCloud()
    ours, theirs = fake_provider(clock, cloud), fake_provider(clock, cloud, cluster="other")
    foreign = await theirs.create(claim("theirs"))

    await reconciler(ours, store, clock).reconcile()

    assert [n.id for n in await theirs.list()] == [foreign.id]
    assert [m for m, _ in ours.calls if m == "delete"] == []


async def test_a_claim_id_is_never_bought_twice(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    first = reconciler(provider, store, clock)
    node = (await first.create_node(claim("c1"))).node
    again = await first.create_node(claim("c1"))  # e.g. a planner that repeated itself
    assert node is not None and again.node is None and again.events == () and again.error is None
    assert creates(provider) == ["c1"] and len(await provider.list()) == 1


async def test_stockout_removes_the_claim_and_reports_the_offering(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    provider.set_stockout("g6.xlarge")
    result = await reconciler(provider, store, clock).create_node(claim("c1"))
    assert result.node is None and result.insufficient is not None
    assert result.insufficient.offering.instance_type == "g6.xlarge"
    assert [e.kind.value for e in result.events] == ["insufficient_capacity"]
    assert await ClaimStore(store, "x").list() == [] and await provider.list() == []


async def test_provider_outage_on_create_leaves_the_claim_pending_for_the_next_round(
        store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    provider.fail_next(1, methods=["create"])
    rec = reconciler(provider, store, clock)
    result = await rec.create_node(claim("c1"))
    assert result.node is None and result.error is not None and result.error.retryable
    [pending] = await ClaimStore(store, "x").list()
    assert pending.phase is ClaimPhase.PENDING

    fleet = await rec.reconcile()

    assert creates(provider) == ["c1", "c1"] and len(await provider.list()) == 1
    assert fleet.claims["c1"].phase is ClaimPhase.CONFIRMED


async def test_unreachable_pool_releases_and_redrives_nothing(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    rec = reconciler(provider, store, clock, kill_at(CLAIM_WRITTEN))
    with pytest.raises(Killed):
        await rec.create_node(claim("c1"))
    provider.fail_next(1, methods=["list"])

    fleet = await reconciler(provider, store, clock).reconcile()

    assert fleet.unreachable_pools == (POOL,)
    assert creates(provider) == []  # the pending claim waits for a round that can see the pool
    assert fleet.claims["c1"].phase is ClaimPhase.PENDING


async def test_a_node_terminated_outside_kvgate_drops_its_claim(store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    rec = reconciler(provider, store, clock)
    node = (await rec.create_node(claim("c1"))).node
    del provider.cloud.nodes[node.id]  # the cloud finished reclaiming it

    fleet = await rec.reconcile()

    assert fleet.claims == {} and [e.kind.value for e in fleet.events] == ["preempted"]


async def test_a_node_still_terminating_after_its_delete_is_not_released_again(store: StateStore, clock) -> None:
    provider = fake_provider(clock, terminate_latency_s=30)
    rec = reconciler(provider, store, clock)
    node = (await rec.create_node(claim("c1"))).node
    await rec.delete_node(node.id, await rec.reconcile(), "empty")
    assert [n.state.value for n in await provider.list()] == ["terminating"]

    fleet = await rec.reconcile()

    assert fleet.events == () and [args for name, args in provider.calls if name == "delete"] == [(node.id,)]
    await clock.advance(30)
    assert await provider.list() == []


@pytest.mark.parametrize("damage", ["newer schema", "malformed"])
async def test_a_node_whose_claim_this_release_cannot_read_is_neither_released_nor_adopted(
        damage: str, store: StateStore, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    # A rolling upgrade: a newer autoscaler wrote a claim of a schema this one cannot read, then lost the lease
    # to it. The node is claimed all the same; releasing it as an orphan would stop a replica that serves.
    provider = fake_provider(clock)
    first = reconciler(provider, store, clock)
    await first.reconcile()  # the ledger is written: an unclaimed node would be released
    node = (await first.create_node(claim("c1"))).node
    [stored] = [r for r in await store.list_records("claims") if r.id == "c1"]
    data = {**stored.data, "schema_version": 2} if damage == "newer schema" else {**stored.data, "phase": 7}
    await store.put_record("claims", "c1", data, expected_version=stored.version)

    for _ in range(2):
        fleet = await reconciler(provider, store, clock, holder="older").reconcile()

    assert [n.id for n in await provider.list()] == [node.id]
    assert [m for m, _ in provider.calls if m == "delete"] == []
    assert "c1" not in fleet.claims and fleet.events == ()
    [kept] = [r for r in await store.list_records("claims") if r.id == "c1"]
    assert kept.data == data  # not rewritten by the reader that could not read it
    newer_lines = [r for r in caplog.records if "schema_version 2" in r.getMessage()]
    assert len(newer_lines) == (2 if damage == "newer schema" else 0)  # one per reconciler (each its own memory)


async def test_claims_carry_their_schema_version_and_older_records_without_it_still_read(
        store: StateStore, clock: FakeClock) -> None:
    provider = fake_provider(clock)
    first = reconciler(provider, store, clock)
    await first.create_node(claim("c1"))
    [stored] = await store.list_records("claims")
    assert stored.data["schema_version"] == 1
    older = {k: v for k, v in stored.data.items() if k != "schema_version"}  # written before the field existed
    await store.put_record("claims", "c1", older, expected_version=stored.version)

    [record] = await ClaimStore(store, "x").list()

    assert record.claim_id == "c1" and record.phase is ClaimPhase.CONFIRMED
