"""The Provider contract (providers/base.py), run against every provider that has a subject_*.py module
(fake, local, and the cloud providers with their real backends: see contract.py)."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.providers.base import (TAG_CLAIM, TAG_CLUSTER, TAG_MODEL, TAG_POOL, InsufficientCapacity, NodeState, NotFound,
                            Offering, OfferingKey, ProviderError, ReplicaSpec)
from tests.providers.contract import ContractSubject

GONE = (NodeState.TERMINATING, NodeState.TERMINATED)


def live_ids(nodes) -> set[str]:
    return {node.id for node in nodes if node.state not in GONE}


async def test_offerings_describe_the_pool(subject: ContractSubject) -> None:
    offerings = await subject.provider.offerings()
    assert offerings, "a pool sells at least one offering"
    for offering in offerings:
        assert isinstance(offering, Offering)
        assert offering.pool == subject.provider.pool
        assert offering.price_usd_per_hour >= 0
        assert offering.gpu_count >= 0
    claim = subject.new_claim()
    assert any(o.key.instance_type == claim.offering.instance_type for o in offerings)


async def test_sold_out_offerings_are_flagged_never_dropped(subject: ContractSubject) -> None:
    before = await subject.provider.offerings()
    claim, expected = await subject.exhaust()
    after = await subject.provider.offerings()
    assert sorted(str(o.key) for o in after) == sorted(str(o.key) for o in before)
    if expected is InsufficientCapacity and subject.flags_stockouts:
        flagged = [o for o in after if o.key == claim.offering]
        assert flagged and not any(o.available for o in flagged)


async def test_create_is_idempotent_on_the_claim_id(subject: ContractSubject) -> None:
    claim = subject.new_claim()
    first = await subject.provider.create(claim)
    second = await subject.provider.create(claim)
    assert second.id == first.id
    assert second.claim_id == first.claim_id == claim.id
    same_claim = [n for n in await subject.provider.list() if n.claim_id == claim.id and n.state not in GONE]
    assert [n.id for n in same_claim] == [first.id], "the second create bought nothing"


async def test_created_nodes_carry_kvgate_tags(subject: ContractSubject) -> None:
    claim = subject.new_claim()
    node = await subject.provider.create(claim)
    assert node.tags[TAG_CLUSTER] == subject.provider.cluster
    assert node.tags[TAG_CLAIM] == claim.id
    assert node.tags[TAG_POOL] == subject.provider.pool
    assert node.tags.get(TAG_MODEL) == claim.model
    assert node.pool == subject.provider.pool
    assert node.instance_type == claim.offering.instance_type
    assert node.capacity_type == claim.offering.capacity_type
    assert node.state in (NodeState.PENDING, NodeState.RUNNING)
    listed = {n.id: n for n in await subject.provider.list()}
    assert listed[node.id].tags[TAG_CLAIM] == claim.id


async def test_delete_of_a_missing_node_succeeds(subject: ContractSubject) -> None:
    await subject.provider.delete("no-such-node-0000")
    node = await subject.provider.create(subject.new_claim())
    await subject.provider.delete(node.id)
    await subject.provider.delete(node.id)  # gone (or going) already: still no error
    assert node.id not in live_ids(await subject.provider.list())


async def test_list_finds_exactly_this_clusters_nodes(subject: ContractSubject) -> None:
    mine = await subject.provider.create(subject.new_claim())
    theirs = await subject.other_cluster.create(subject.new_claim())
    assert mine.id != theirs.id
    assert live_ids(await subject.provider.list()) == {mine.id}
    assert live_ids(await subject.other_cluster.list()) == {theirs.id}
    for node in await subject.provider.list():
        assert node.tags[TAG_CLUSTER] == subject.provider.cluster


async def test_capacity_errors_are_typed(subject: ContractSubject) -> None:
    claim, expected = await subject.exhaust()
    assert issubclass(expected, ProviderError)
    with pytest.raises(expected) as raised:
        await subject.provider.create(claim)
    assert str(raised.value), "the error says what happened"
    if isinstance(raised.value, InsufficientCapacity):
        assert raised.value.offering == claim.offering, "the planner skips the offering it names"
    assert claim.id not in {n.claim_id for n in await subject.provider.list() if n.state not in GONE}


async def test_an_offering_the_pool_does_not_sell_is_not_found(subject: ContractSubject) -> None:
    claim = subject.new_claim()
    bogus = dataclasses.replace(claim, offering=OfferingKey(claim.pool, "no-such-instance-type",
                                                            claim.offering.capacity_type))
    with pytest.raises(NotFound):
        await subject.provider.create(bogus)


async def test_replica_calls_on_unknown_ids(subject: ContractSubject) -> None:
    with pytest.raises(NotFound):
        await subject.provider.start_replica("no-such-node-0000", ReplicaSpec(model="m", source="builtin:tiny-llama"))
    await subject.provider.stop_replica("no-such-replica-0000", drain_deadline_s=0.1)
    assert await subject.provider.list_replicas() == []
