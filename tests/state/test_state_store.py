"""The state store specification. Every test taking `store` runs against MemoryStateStore and
against RedisStateStore on a real redis-server, both on a FakeClock (time moves only by `advance`)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from kvgate.clock import FakeClock
from kvgate.state import (
    MemberRecord,
    MemoryStateStore,
    RedisStateStore,
    ReplicaState,
    StateStore,
    StateStoreUnavailable,
    VersionConflict,
    open_state_store,
    redact_url,
)

MakeRedisStore = Callable[..., RedisStateStore]  # the make_redis_store fixture


def member(replica_id: str, model: str = "llama", state: str = "ready") -> MemberRecord:
    return MemberRecord(
        replica_id=replica_id,
        model=model,
        url=f"http://{replica_id}:8000",
        grpc_target=f"{replica_id}:9000",
        state=ReplicaState(state),
        node_id="node-1",
        pool="local",
    )


async def test_both_implementations_satisfy_the_protocol(store: StateStore) -> None:
    assert isinstance(store, StateStore)


# -- membership ------------------------------------------------------------------------------------


async def test_put_member_is_listed_with_updated_at_set_by_the_store(
    store: StateStore, clock: FakeClock
) -> None:
    stored = await store.put_member(member("r1"), ttl_s=10)
    assert stored == dataclasses.replace(member("r1"), updated_at=clock.wall())
    assert await store.list_members() == [stored]


async def test_put_member_again_replaces_the_record(store: StateStore) -> None:
    await store.put_member(member("r1", state="starting"), ttl_s=10)
    await store.put_member(member("r1", state="ready"), ttl_s=10)
    [listed] = await store.list_members()
    assert listed.state is ReplicaState.READY


async def test_list_members_filters_by_model_and_sorts_by_replica_id(store: StateStore) -> None:
    for replica_id, model in [("r3", "llama"), ("r1", "llama"), ("r2", "qwen")]:
        await store.put_member(member(replica_id, model), ttl_s=10)
    assert [m.replica_id for m in await store.list_members()] == ["r1", "r2", "r3"]
    assert [m.replica_id for m in await store.list_members("llama")] == ["r1", "r3"]
    assert await store.list_members("unknown") == []


async def test_member_is_live_until_its_ttl_passes(store: StateStore, clock: FakeClock) -> None:
    await store.put_member(member("r1"), ttl_s=10)
    await clock.advance(9.5)
    assert len(await store.list_members()) == 1
    await clock.advance(0.5)  # exactly 10 s after the put: expired
    assert await store.list_members() == []


async def test_heartbeat_pushes_expiry_to_ttl_after_the_last_put(
    store: StateStore, clock: FakeClock
) -> None:
    await store.put_member(member("r1"), ttl_s=10)
    await clock.advance(8)
    await store.put_member(member("r1"), ttl_s=10)  # now live until 18 s
    await clock.advance(8)  # 16 s: past the first expiry, before the second
    assert [m.replica_id for m in await store.list_members()] == ["r1"]


async def test_listing_deletes_expired_members(
    store: StateStore, clock: FakeClock
) -> None:
    await store.put_member(member("r1"), ttl_s=5)
    await store.put_member(member("r2"), ttl_s=60)
    await clock.advance(10)
    assert [m.replica_id for m in await store.list_members()] == ["r2"]
    assert await store.remove_member("r1") is False  # lazily deleted by the listing


async def test_remove_member_deletes_it(store: StateStore) -> None:
    await store.put_member(member("r1"), ttl_s=10)
    assert await store.remove_member("r1") is True
    assert await store.list_members() == []


async def test_remove_absent_member_succeeds_and_says_so(store: StateStore) -> None:
    assert await store.remove_member("never-there") is False


async def test_member_state_may_be_given_as_a_string() -> None:
    record = MemberRecord("r1", "llama", "http://r1", state="draining")  # type: ignore[arg-type]
    assert record.state is ReplicaState.DRAINING
    with pytest.raises(ValueError):
        MemberRecord("r1", "llama", "http://r1", state="sleeping")  # type: ignore[arg-type]


# -- counters --------------------------------------------------------------------------------------


async def test_unknown_counter_reads_zero(store: StateStore) -> None:
    assert await store.get_counter("in-flight:llama") == 0


async def test_incr_adds_deltas_and_returns_the_new_value(store: StateStore) -> None:
    assert await store.incr("c", ttl_s=30) == 1
    assert await store.incr("c", 5, ttl_s=30) == 6
    assert await store.incr("c", -2, ttl_s=30) == 4
    assert await store.get_counter("c") == 4


async def test_counter_expires_ttl_after_its_last_change(store: StateStore, clock: FakeClock) -> None:
    await store.incr("c", 3, ttl_s=30)
    await clock.advance(20)
    await store.incr("c", 1, ttl_s=30)  # value 4, now live until 50 s
    await clock.advance(29)  # 49 s
    assert await store.get_counter("c") == 4
    await clock.advance(1)  # 50 s
    assert await store.get_counter("c") == 0


async def test_incr_after_expiry_restarts_from_zero(store: StateStore, clock: FakeClock) -> None:
    await store.incr("c", 7, ttl_s=30)
    await clock.advance(30)
    assert await store.incr("c", 2, ttl_s=30) == 2


async def test_incr_rejects_a_non_integer_delta_and_a_non_positive_ttl(store: StateStore) -> None:
    with pytest.raises(ValueError):
        await store.incr("c", 1.5, ttl_s=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.incr("c", 1, ttl_s=0)


# -- token buckets ---------------------------------------------------------------------------------


async def test_bucket_starts_full(store: StateStore) -> None:
    result = await store.take_tokens("tenant-a", capacity=10, refill_per_s=2, cost=10)
    assert (result.allowed, result.remaining, result.retry_after_s) == (True, 0.0, 0.0)


async def test_empty_bucket_denies_with_time_until_the_cost_has_refilled(store: StateStore) -> None:
    # Capacity 10, refill 2/s: take all 10, then 1 more at the same instant is denied; one token
    # takes 1 / 2 = 0.5 s to refill.
    await store.take_tokens("b", capacity=10, refill_per_s=2, cost=10)
    result = await store.take_tokens("b", capacity=10, refill_per_s=2, cost=1)
    assert (result.allowed, result.remaining) == (False, 0.0)
    assert result.retry_after_s == pytest.approx(0.5)


async def test_denied_take_leaves_the_tokens_in_the_bucket(store: StateStore) -> None:
    # Capacity 10, refill 2/s: take 7 leaves 3; a cost of 5 is denied (retry (5 - 3) / 2 = 1 s),
    # and the 3 tokens are still there for a cost of 3.
    await store.take_tokens("b", capacity=10, refill_per_s=2, cost=7)
    denied = await store.take_tokens("b", capacity=10, refill_per_s=2, cost=5)
    assert (denied.allowed, denied.remaining, denied.retry_after_s) == (False, 3.0, 1.0)
    assert (await store.take_tokens("b", capacity=10, refill_per_s=2, cost=3)).allowed


async def test_bucket_refills_over_time(store: StateStore, clock: FakeClock) -> None:
    # Capacity 10, refill 2/s: empty at t=0; at t=0.5 one token is back; at t=2, four more.
    await store.take_tokens("b", capacity=10, refill_per_s=2, cost=10)
    await clock.advance(0.5)
    first = await store.take_tokens("b", capacity=10, refill_per_s=2, cost=1)
    assert (first.allowed, first.remaining) == (True, 0.0)
    await clock.advance(2)
    assert (await store.take_tokens("b", capacity=10, refill_per_s=2, cost=1)).remaining == 3.0


async def test_refill_stops_at_capacity(store: StateStore, clock: FakeClock) -> None:
    await store.take_tokens("b", capacity=10, refill_per_s=2, cost=10)
    await clock.advance(3600)  # 7200 tokens' worth of refill, capped at 10
    assert (await store.take_tokens("b", capacity=10, refill_per_s=2, cost=1)).remaining == 9.0


async def test_cost_above_capacity_is_never_allowed(store: StateStore) -> None:
    result = await store.take_tokens("b", capacity=10, refill_per_s=2, cost=11)
    assert (result.allowed, result.remaining, result.retry_after_s) == (False, 10.0, math.inf)


async def test_bucket_without_refill_never_recovers(store: StateStore, clock: FakeClock) -> None:
    await store.take_tokens("b", capacity=3, refill_per_s=0, cost=3)
    await clock.advance(1_000_000)
    result = await store.take_tokens("b", capacity=3, refill_per_s=0, cost=1)
    assert (result.allowed, result.retry_after_s) == (False, math.inf)


async def test_buckets_are_independent_per_key(store: StateStore) -> None:
    await store.take_tokens("a", capacity=1, refill_per_s=1)
    assert (await store.take_tokens("b", capacity=1, refill_per_s=1)).allowed


async def test_concurrent_takes_never_overdraw_the_bucket(store: StateStore) -> None:
    # 50 requests race for a bucket of 20 with no time passing: exactly 20 win.
    results = await asyncio.gather(
        *(store.take_tokens("race", capacity=20, refill_per_s=1) for _ in range(50))
    )
    assert sum(r.allowed for r in results) == 20


@pytest.mark.parametrize(
    ("capacity", "refill_per_s", "cost"), [(0, 1, 1), (10, -1, 1), (10, 1, 0), (10, 1, -2)]
)
async def test_take_tokens_rejects_invalid_arguments(
    store: StateStore, capacity: float, refill_per_s: float, cost: float
) -> None:
    with pytest.raises(ValueError):
        await store.take_tokens("b", capacity=capacity, refill_per_s=refill_per_s, cost=cost)


# -- leases ----------------------------------------------------------------------------------------


async def test_free_lease_is_acquired(store: StateStore) -> None:
    assert await store.lease_holder("autoscaler") is None
    assert await store.acquire_lease("autoscaler", "a", ttl_s=15) is True
    assert await store.lease_holder("autoscaler") == "a"


async def test_live_lease_is_refused_to_another_holder(store: StateStore) -> None:
    await store.acquire_lease("autoscaler", "a", ttl_s=15)
    assert await store.acquire_lease("autoscaler", "b", ttl_s=15) is False
    assert await store.lease_holder("autoscaler") == "a"


async def test_holder_renews_its_lease(store: StateStore, clock: FakeClock) -> None:
    await store.acquire_lease("autoscaler", "a", ttl_s=15)
    await clock.advance(10)
    assert await store.acquire_lease("autoscaler", "a", ttl_s=15) is True  # live until 25 s
    await clock.advance(10)  # 20 s: past the first expiry
    assert await store.acquire_lease("autoscaler", "b", ttl_s=15) is False


async def test_expired_lease_passes_to_another_holder(store: StateStore, clock: FakeClock) -> None:
    await store.acquire_lease("autoscaler", "a", ttl_s=15)
    await clock.advance(15)
    assert await store.lease_holder("autoscaler") is None
    assert await store.acquire_lease("autoscaler", "b", ttl_s=15) is True
    assert await store.lease_holder("autoscaler") == "b"


async def test_only_the_holder_releases_a_lease(store: StateStore) -> None:
    await store.acquire_lease("autoscaler", "a", ttl_s=15)
    assert await store.release_lease("autoscaler", "b") is False
    assert await store.lease_holder("autoscaler") == "a"
    assert await store.release_lease("autoscaler", "a") is True
    assert await store.lease_holder("autoscaler") is None
    assert await store.acquire_lease("autoscaler", "b", ttl_s=15) is True


async def test_releasing_an_expired_lease_returns_false(store: StateStore, clock: FakeClock) -> None:
    await store.acquire_lease("autoscaler", "a", ttl_s=15)
    await clock.advance(20)
    assert await store.release_lease("autoscaler", "a") is False


async def test_concurrent_acquires_elect_exactly_one_holder(store: StateStore) -> None:
    won = await asyncio.gather(
        *(store.acquire_lease("autoscaler", f"h{i}", ttl_s=15) for i in range(20))
    )
    assert sum(won) == 1


# -- durable records -------------------------------------------------------------------------------


async def test_create_if_absent_succeeds_once(store: StateStore) -> None:
    assert await store.put_record("claims", "c1", {"offer": "g5"}, expected_version=0) == 1
    with pytest.raises(VersionConflict) as conflict:
        await store.put_record("claims", "c1", {"offer": "p4"}, expected_version=0)
    assert (conflict.value.expected_version, conflict.value.current_version) == (0, 1)
    assert (await store.get_record("claims", "c1")).data == {"offer": "g5"}  # type: ignore[union-attr]


async def test_put_at_the_expected_version_bumps_it(store: StateStore) -> None:
    await store.put_record("claims", "c1", {"phase": "pending"})
    assert await store.put_record("claims", "c1", {"phase": "launched"}, expected_version=1) == 2
    record = await store.get_record("claims", "c1")
    assert record is not None and (record.version, record.data["phase"]) == (2, "launched")


async def test_put_at_a_stale_version_conflicts_and_writes_nothing(store: StateStore) -> None:
    await store.put_record("claims", "c1", {"phase": "pending"})
    await store.put_record("claims", "c1", {"phase": "launched"})
    with pytest.raises(VersionConflict) as conflict:
        await store.put_record("claims", "c1", {"phase": "deleted"}, expected_version=1)
    assert conflict.value.current_version == 2
    assert (await store.get_record("claims", "c1")).data == {"phase": "launched"}  # type: ignore[union-attr]


async def test_put_expecting_a_version_of_an_absent_record_conflicts(store: StateStore) -> None:
    with pytest.raises(VersionConflict) as conflict:
        await store.put_record("claims", "c1", {}, expected_version=3)
    assert conflict.value.current_version == 0
    assert await store.get_record("claims", "c1") is None


async def test_unconditional_puts_count_versions_up(store: StateStore) -> None:
    versions = [await store.put_record("claims", "c1", {"n": n}) for n in range(3)]
    assert versions == [1, 2, 3]


async def test_concurrent_creates_if_absent_let_exactly_one_win(store: StateStore) -> None:
    async def create(n: int) -> bool:
        try:
            await store.put_record("claims", "c1", {"by": n}, expected_version=0)
            return True
        except VersionConflict:
            return False

    assert sum(await asyncio.gather(*(create(n) for n in range(20)))) == 1


async def test_delete_at_a_stale_version_conflicts_and_keeps_the_record(store: StateStore) -> None:
    await store.put_record("claims", "c1", {})
    await store.put_record("claims", "c1", {})
    with pytest.raises(VersionConflict):
        await store.delete_record("claims", "c1", expected_version=1)
    assert await store.delete_record("claims", "c1", expected_version=2) is True
    assert await store.get_record("claims", "c1") is None


async def test_delete_of_an_absent_record_returns_false(store: StateStore) -> None:
    assert await store.delete_record("claims", "nope") is False
    assert await store.delete_record("claims", "nope", expected_version=0) is False


async def test_recreated_record_starts_again_at_version_one(store: StateStore) -> None:
    await store.put_record("claims", "c1", {})
    await store.put_record("claims", "c1", {})
    await store.delete_record("claims", "c1")
    assert await store.put_record("claims", "c1", {}, expected_version=0) == 1


async def test_list_records_is_sorted_by_id_and_scoped_to_the_collection(store: StateStore) -> None:
    for record_id in ["c3", "c1", "c2"]:
        await store.put_record("claims", record_id, {"id": record_id})
    await store.put_record("nodes", "n1", {})
    listed = await store.list_records("claims")
    assert [(r.collection, r.id, r.version) for r in listed] == [
        ("claims", "c1", 1),
        ("claims", "c2", 1),
        ("claims", "c3", 1),
    ]
    assert await store.list_records("empty") == []


async def test_records_never_expire(store: StateStore, clock: FakeClock) -> None:
    await store.put_record("claims", "c1", {"x": 1})
    await clock.advance(10 * 365 * 86_400)
    assert await store.get_record("claims", "c1") is not None


async def test_record_data_read_back_is_deeply_immutable(store: StateStore) -> None:
    await store.put_record("claims", "c1", {"tags": {"pool": "aws"}, "gpus": [1, 2]})
    record = await store.get_record("claims", "c1")
    assert record is not None
    with pytest.raises(TypeError):
        record.data["new"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        record.data["tags"]["pool"] = "gcp"
    assert record.data["gpus"] == (1, 2)


async def test_caller_changes_after_a_put_do_not_reach_the_store(store: StateStore) -> None:
    data = {"tags": {"pool": "aws"}}
    await store.put_record("claims", "c1", data)
    data["tags"]["pool"] = "gcp"
    assert (await store.get_record("claims", "c1")).data["tags"]["pool"] == "aws"  # type: ignore[union-attr]


async def test_record_data_read_back_can_be_written_again(store: StateStore) -> None:
    await store.put_record("claims", "c1", {"tags": {"pool": "aws"}, "gpus": [1]})
    record = await store.get_record("claims", "c1")
    assert record is not None
    await store.put_record("claims", "c2", record.data)
    assert (await store.get_record("claims", "c2")).data == record.data  # type: ignore[union-attr]


@pytest.mark.parametrize("data", [{"when": object()}, {"x": float("nan")}, ["not", "a", "mapping"]])
async def test_non_json_record_data_is_rejected(store: StateStore, data: object) -> None:
    with pytest.raises(ValueError):
        await store.put_record("claims", "c1", data)  # type: ignore[arg-type]
    assert await store.get_record("claims", "c1") is None


# -- lifecycle and construction --------------------------------------------------------------------


async def test_closed_store_is_unavailable(store: StateStore) -> None:
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StateStoreUnavailable):
        await store.get_counter("c")


async def test_open_state_store_picks_the_implementation_by_scheme(clock: FakeClock) -> None:
    memory = open_state_store("memory://", clock)
    shared = open_state_store("redis://127.0.0.1:6379/0", clock)  # connects on first use only
    assert isinstance(memory, MemoryStateStore) and isinstance(shared, RedisStateStore)
    await memory.close()
    await shared.close()


def test_open_state_store_names_the_allowed_schemes(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match=r"memory://, redis://, rediss://"):
        open_state_store("etcd://localhost:2379", clock)


# -- Redis only: sharing, namespacing, garbage collection, failure ---------------------------------


async def test_two_gateways_share_state(make_redis_store: MakeRedisStore) -> None:
    gateway_a, gateway_b = make_redis_store(), make_redis_store()
    await gateway_a.put_member(member("r1"), ttl_s=10)
    await gateway_a.incr("in-flight:r1", 3, ttl_s=30)
    await gateway_a.take_tokens("tenant", capacity=2, refill_per_s=1, cost=2)
    await gateway_a.acquire_lease("autoscaler", "a", ttl_s=15)
    assert [m.replica_id for m in await gateway_b.list_members()] == ["r1"]
    assert await gateway_b.get_counter("in-flight:r1") == 3
    assert not (await gateway_b.take_tokens("tenant", capacity=2, refill_per_s=1)).allowed
    assert await gateway_b.acquire_lease("autoscaler", "b", ttl_s=15) is False


async def test_gateways_racing_across_connections_share_one_bucket(
    make_redis_store: MakeRedisStore,
) -> None:
    gateways = [make_redis_store() for _ in range(5)]
    results = await asyncio.gather(
        *(g.take_tokens("race", capacity=20, refill_per_s=1) for g in gateways for _ in range(10))
    )
    assert sum(r.allowed for r in results) == 20


async def test_prefixes_keep_clusters_apart(make_redis_store: MakeRedisStore, prefix: str) -> None:
    cluster_a, cluster_b = make_redis_store(prefix=prefix + "a:"), make_redis_store(prefix=prefix + "b:")
    await cluster_a.put_record("claims", "c1", {})
    assert await cluster_b.get_record("claims", "c1") is None


async def test_redis_keys_carry_a_backstop_ttl_of_logical_ttl_plus_slack(
    make_redis_store: MakeRedisStore, redis_url: str, prefix: str
) -> None:
    # The logical ttl is 10 s; Redis may delete the key 60 s of slack after that, no sooner.
    store = make_redis_store()
    await store.acquire_lease("autoscaler", "a", ttl_s=10)
    await store.put_record("claims", "c1", {})
    raw = aioredis.Redis.from_url(redis_url)
    try:
        assert 69_000 < await raw.pttl(f"{prefix}lease:autoscaler") <= 70_000
        assert await raw.pttl(f"{prefix}records:claims") == -1  # records never expire
    finally:
        await raw.aclose()


async def test_unreachable_redis_raises_state_store_unavailable(
    make_redis_store: MakeRedisStore, unreachable_redis_url: str
) -> None:
    store = make_redis_store(url=unreachable_redis_url, timeout_s=0.5)
    with pytest.raises(StateStoreUnavailable):
        await store.take_tokens("b", capacity=1, refill_per_s=1)
    with pytest.raises(StateStoreUnavailable):
        await store.list_members()


async def test_an_unreachable_redis_is_named_in_the_error_without_its_password(
    make_redis_store: MakeRedisStore, unreachable_redis_url: str
) -> None:
    url = unreachable_redis_url.replace("redis://", "redis://kvgate:hunter2@")
    store = make_redis_store(url=url, timeout_s=0.5)
    with pytest.raises(StateStoreUnavailable) as raised:
        await store.list_members()
    message = str(raised.value)
    assert message.startswith(f"state store {redact_url(url)} unreachable: Error 111 connecting to ")
    assert "hunter2" not in message and "kvgate:***@127.0.0.1" in message


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    ("rediss://kvgate:s3cret@redis.prod:6380/1", "rediss://kvgate:***@redis.prod:6380/1"),
    ("redis://redis:6379/0?password=s3cret&socket_timeout=2", "redis://redis:6379/0?password=***&socket_timeout=2"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing secret: unchanged
    ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
    # Generated passwords written unencoded: urlsplit would read part of them as the path or fragment.
    ("redis://:pa/ss@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://:pa#ss@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://:p?ss@h:6380/0", "rediss://:***@h:6380/0"),
])
def test_a_url_shown_in_logs_keeps_everything_but_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
