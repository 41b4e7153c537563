"""`StateStore.take_quota` and `return_quota` on both stores (memory and a real redis-server): a slot counter and
token buckets taken together, all or nothing, and given back, with debt down to a floor."""

from __future__ import annotations

import math

import pytest

from kvgate.clock import FakeClock
from kvgate.state import StateStore
from kvgate.state.quota import SLOT_REFUSED, BucketGive, BucketTake, QuotaResult, Slot, decide_take
from tests.state.conftest import MakeRedisStore

SLOT = Slot("{t}:in_flight", limit=2, ttl_s=600)


def take(key: str, amount: float, capacity: float = 100, refill_per_s: float = 1) -> BucketTake:
    return BucketTake(key, capacity, refill_per_s, amount)


def give(key: str, delta: float, capacity: float = 100, refill_per_s: float = 1, floor: float = -100) -> BucketGive:
    return BucketGive(key, capacity, refill_per_s, delta, floor)


async def test_a_take_counts_the_slot_and_takes_from_every_bucket(store: StateStore) -> None:
    result = await store.take_quota(SLOT, [take("{t}:req", 1), take("{t}:tok", 30)])
    assert result == QuotaResult(True, None, (99.0, 70.0), 0.0)
    assert await store.get_counter(SLOT.key) == 1


async def test_a_full_slot_refuses_and_takes_nothing(store: StateStore) -> None:
    for _ in range(2):
        assert (await store.take_quota(SLOT, [take("{t}:req", 1)])).allowed
    refused = await store.take_quota(SLOT, [take("{t}:req", 1)])
    assert refused == QuotaResult(False, SLOT_REFUSED, (98.0,), 0.0)
    assert await store.get_counter(SLOT.key) == 2


async def test_a_bucket_that_refuses_leaves_the_others_and_the_slot_untouched(store: StateStore) -> None:
    await store.take_quota(None, [take("{t}:tok", 70, refill_per_s=2)])  # 30 left
    refused = await store.take_quota(SLOT, [take("{t}:req", 1), take("{t}:tok", 50, refill_per_s=2)])
    assert refused == QuotaResult(False, 2, (100.0, 30.0), 10.0)  # (50 - 30) / 2 s
    assert await store.get_counter(SLOT.key) == 0
    assert (await store.take_quota(None, [take("{t}:req", 100)])).allowed  # the request bucket is still full


async def test_a_take_above_capacity_is_never_allowed(store: StateStore) -> None:
    refused = await store.take_quota(None, [take("{t}:tok", 101)])
    assert not refused.allowed and refused.retry_after_s == math.inf


async def test_returning_counts_out_and_gives_back_within_capacity(store: StateStore) -> None:
    await store.take_quota(SLOT, [take("{t}:tok", 70)])
    await store.return_quota(SLOT, give("{t}:tok", 90))
    assert await store.get_counter(SLOT.key) == 0
    assert (await store.take_quota(None, [take("{t}:tok", 100)])).levels == (0.0,)


async def test_a_slot_that_lapsed_is_never_counted_below_zero(store: StateStore, clock: FakeClock) -> None:
    await store.take_quota(SLOT, [])
    await clock.advance(601)  # the counter lapsed while the request ran
    await store.return_quota(SLOT, None)
    await store.return_quota(SLOT, None)
    assert await store.get_counter(SLOT.key) == 0
    for _ in range(2):
        assert (await store.take_quota(SLOT, [])).allowed
    assert not (await store.take_quota(SLOT, [])).allowed


async def test_an_overrun_is_debt_down_to_the_floor_that_the_next_take_waits_for(store: StateStore) -> None:
    # 10 reserved of a 10-token bucket, 500 used: the debt stops at the floor, -300; a take of 5 then needs
    # (5 + 300) / 5 = 61 s of refill.
    await store.take_quota(None, [take("{t}:tok", 10, capacity=10, refill_per_s=5)])
    await store.return_quota(None, give("{t}:tok", -490, capacity=10, refill_per_s=5, floor=-300))
    refused = await store.take_quota(None, [take("{t}:tok", 5, capacity=10, refill_per_s=5)])
    assert refused == QuotaResult(False, 1, (-300.0,), 61.0)


async def test_returning_refills_for_the_time_that_passed_first(store: StateStore, clock: FakeClock) -> None:
    await store.take_quota(None, [take("{t}:tok", 100, refill_per_s=2)])
    await clock.advance(10)  # +20
    await store.return_quota(None, give("{t}:tok", 5, refill_per_s=2))
    assert (await store.take_quota(None, [take("{t}:tok", 1, refill_per_s=2)])).levels == (24.0,)


async def test_two_gateways_share_the_slot_and_the_buckets(make_redis_store: MakeRedisStore) -> None:
    a, b = make_redis_store(), make_redis_store()
    assert (await a.take_quota(SLOT, [take("{t}:req", 60)])).allowed
    assert (await b.take_quota(SLOT, [take("{t}:req", 40)])).allowed
    assert (await a.take_quota(SLOT, [take("{t}:req", 1)])).refused == SLOT_REFUSED
    await b.return_quota(SLOT, give("{t}:req", 60))
    assert (await a.take_quota(SLOT, [take("{t}:req", 60)])).allowed


def test_the_decision_names_the_first_limit_that_refuses() -> None:
    takes = [take("r", 1, capacity=1000, refill_per_s=10), take("k", 400, capacity=1000, refill_per_s=10)]
    assert decide_take(None, None, [5, 300], takes) == QuotaResult(False, 2, (5, 300), 10.0)
    assert decide_take(2, SLOT, [5, 300], takes).refused == SLOT_REFUSED
    assert decide_take(1, SLOT, [5, 500], takes) == QuotaResult(True, None, (4, 100), 0.0)
    assert decide_take(0, SLOT, [0, 500], [take("r", 1, refill_per_s=0)] * 2).retry_after_s == math.inf


@pytest.mark.parametrize("build", [
    lambda: Slot("", 1, 1), lambda: Slot("k", 0, 1), lambda: Slot("k", 1, 0), lambda: Slot("k", True, 1),
    lambda: BucketTake("k", 0, 1, 1), lambda: BucketTake("k", 10, -1, 1), lambda: BucketTake("k", 10, 1, 0),
    lambda: BucketTake("k", math.inf, 1, 1), lambda: BucketGive("k", 10, 1, math.nan, 0),
    lambda: BucketGive("k", 10, 1, 1, 5), lambda: BucketGive("k", 10, 1, True, 0)])
def test_invalid_quotas_are_refused_before_any_io(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]
