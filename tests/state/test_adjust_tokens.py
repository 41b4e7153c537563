"""`StateStore.adjust_tokens`, the settlement of a token bucket, on both stores (memory and a real redis-server):
what a request reserved and did not use goes back, an overrun is charged as debt, never past one bucket."""

from __future__ import annotations

import math

import pytest

from kvgate.clock import FakeClock
from kvgate.state import StateStore
from tests.state.conftest import MakeRedisStore


async def test_giving_back_unused_tokens_refills_the_bucket_at_once(store: StateStore) -> None:
    await store.take_tokens("t", capacity=100, refill_per_s=1, cost=70)  # 30 left
    assert await store.adjust_tokens("t", capacity=100, refill_per_s=1, delta=50) == 80.0
    assert (await store.take_tokens("t", capacity=100, refill_per_s=1, cost=80)).allowed


async def test_giving_back_never_fills_past_capacity(store: StateStore) -> None:
    await store.take_tokens("t", capacity=100, refill_per_s=1, cost=10)
    assert await store.adjust_tokens("t", capacity=100, refill_per_s=1, delta=90) == 100.0


async def test_an_overrun_leaves_debt_that_the_next_take_waits_for(store: StateStore) -> None:
    # 100 reserved of 100, 130 used: 30 tokens of debt; a take of 10 needs (10 + 30) / 2 = 20 s of refill.
    await store.take_tokens("t", capacity=100, refill_per_s=2, cost=100)
    assert await store.adjust_tokens("t", capacity=100, refill_per_s=2, delta=-30) == -30.0
    denied = await store.take_tokens("t", capacity=100, refill_per_s=2, cost=10)
    assert not denied.allowed and denied.remaining == -30.0 and denied.retry_after_s == 20.0


async def test_debt_is_capped_at_one_bucket(store: StateStore) -> None:
    await store.take_tokens("t", capacity=100, refill_per_s=1, cost=100)
    assert await store.adjust_tokens("t", capacity=100, refill_per_s=1, delta=-1_000) == -100.0


async def test_adjusting_refills_for_the_time_that_passed_first(store: StateStore, clock: FakeClock) -> None:
    await store.take_tokens("t", capacity=100, refill_per_s=2, cost=100)
    await clock.advance(10)  # +20
    assert await store.adjust_tokens("t", capacity=100, refill_per_s=2, delta=5) == 25.0


async def test_adjusting_an_absent_bucket_starts_from_full(store: StateStore) -> None:
    assert await store.adjust_tokens("new", capacity=100, refill_per_s=1, delta=-40) == 60.0


async def test_debt_is_paid_back_by_refill(store: StateStore, clock: FakeClock) -> None:
    await store.take_tokens("t", capacity=10, refill_per_s=1, cost=10)
    await store.adjust_tokens("t", capacity=10, refill_per_s=1, delta=-10)  # -10
    await clock.advance(15)
    result = await store.take_tokens("t", capacity=10, refill_per_s=1, cost=5)
    assert result.allowed and result.remaining == 0.0


async def test_two_gateways_settle_into_one_bucket(make_redis_store: MakeRedisStore) -> None:
    a, b = make_redis_store(), make_redis_store()
    await a.take_tokens("shared", capacity=100, refill_per_s=1, cost=100)
    await b.adjust_tokens("shared", capacity=100, refill_per_s=1, delta=60)
    assert (await a.take_tokens("shared", capacity=100, refill_per_s=1, cost=60)).allowed


@pytest.mark.parametrize("capacity, refill_per_s, delta", [
    (0, 1, 1), (10, -1, 1), (10, 1, math.inf), (10, 1, math.nan), (math.inf, 1, 1), (10, 1, True)])
async def test_adjust_tokens_rejects_invalid_arguments(
        store: StateStore, capacity: float, refill_per_s: float, delta: float) -> None:
    with pytest.raises(ValueError):
        await store.adjust_tokens("t", capacity=capacity, refill_per_s=refill_per_s, delta=delta)
