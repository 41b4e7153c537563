"""Quotas: a counter of things in flight and token buckets, taken together in one atomic step and given back in
another (`StateStore.take_quota` / `StateStore.return_quota`).

A gateway admits a tenant's request against up to three limits at once (concurrent requests, requests per minute,
tokens per minute). Taken one store call at a time, that was three round trips to Redis and, when a later limit
refused, more round trips to give back what the earlier ones took. As one step it is one round trip, and a refusal
takes nothing, so nothing has to be given back.

The types cross to Redis as script arguments; the decision itself (`decide_take`) is pure, shared by the memory
store and mirrored line for line by the Redis store's Lua script.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.state.base import check_bucket_args, check_name, check_ttl_s


@dataclass(frozen=True, slots=True)
class Slot:
    """A counter of things in flight (a tenant's concurrent requests), at most `limit` at once. It lapses
    `ttl_s` after its last change, so what a dead process left counted is forgotten."""

    key: str
    limit: int
    ttl_s: float

    def __post_init__(self) -> None:
        check_name("slot key", self.key)
        check_ttl_s(self.ttl_s)
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"slot limit must be an int >= 1, got {self.limit!r}")


@dataclass(frozen=True, slots=True)
class BucketTake:
    """Take `amount` from the token bucket `key` (capacity and refill as in `StateStore.take_tokens`)."""

    key: str
    capacity: float
    refill_per_s: float
    amount: float

    def __post_init__(self) -> None:
        check_name("bucket key", self.key)
        check_bucket_args(self.capacity, self.refill_per_s, self.amount)


@dataclass(frozen=True, slots=True)
class BucketGive:
    """Add `delta` to the bucket `key` after its refill, kept within [`floor`, capacity]: a positive delta gives
    back what a take reserved and did not use, a negative one charges an overrun as debt down to `floor` (<= 0),
    which the next takes wait to be paid back."""

    key: str
    capacity: float
    refill_per_s: float
    delta: float
    floor: float

    def __post_init__(self) -> None:
        check_name("bucket key", self.key)
        check_bucket_args(self.capacity, self.refill_per_s, 1.0)
        for name, value in (("delta", self.delta), ("floor", self.floor)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.floor > 0:
            raise ValueError(f"floor must be <= 0, got {self.floor!r}")


SLOT_REFUSED = 0  # `QuotaResult.refused` when the slot was full; i >= 1 names takes[i - 1]


@dataclass(frozen=True, slots=True)
class QuotaResult:
    """The answer of one `take_quota`: all taken, or nothing taken and what refused."""

    allowed: bool
    refused: int | None  # None when allowed; SLOT_REFUSED (0); or i >= 1: takes[i - 1] had too little
    levels: tuple[float, ...]  # each bucket's tokens after the call (after the take when allowed)
    retry_after_s: float  # 0 when allowed or the slot refused; math.inf when a take exceeds its capacity


def decide_take(in_flight: int | None, slot: Slot | None, levels: Sequence[float],
                takes: Sequence[BucketTake]) -> QuotaResult:
    """Whether a request with the slot count `in_flight` and the refilled bucket `levels` may take `takes`.

    Worked numbers: a slot at 2 of limit 2 refuses (refused 0) and takes nothing. Buckets at 5 and 300, takes of
    1 and 400 (capacity 1000, refill 10/s): the second refuses, retry after (400 - 300) / 10 = 10 s, and both
    buckets keep what they had. Takes of 1 and 200: allowed, levels 4 and 100.
    """
    if slot is not None and (in_flight or 0) + 1 > slot.limit:
        return QuotaResult(False, SLOT_REFUSED, tuple(levels), 0.0)
    for index, (level, take) in enumerate(zip(levels, takes, strict=True), start=1):
        if take.amount > take.capacity:
            return QuotaResult(False, index, tuple(levels), math.inf)
        if level < take.amount:
            retry = math.inf if take.refill_per_s == 0 else (take.amount - level) / take.refill_per_s
            return QuotaResult(False, index, tuple(levels), retry)
    return QuotaResult(True, None, tuple(level - take.amount for level, take in zip(levels, takes)), 0.0)
