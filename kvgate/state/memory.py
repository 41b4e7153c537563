"""`MemoryStateStore`: the state store of one process (`kvgate up`), and the fake beside the interface.

Atomicity under asyncio: every method body runs without an `await`, so the read and the write of
shared state happen in one step of the event loop and no other task can interleave. Keep it so: an
`await` between a read and its write here would break the token bucket and the lease.

Durable records are stored as the same canonical JSON the Redis store writes and decoded on every
read, so both stores agree on what round-trips (a tuple comes back as a tuple, a dict as a read-only
mapping) and no caller can mutate stored state through an object it gave or got. Member records are
frozen dataclasses and are kept as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from kvgate.clock import Clock
from kvgate.state.base import (
    JSONValue, MemberRecord, StateStoreUnavailable, StoredRecord, TokenBucketResult, VersionConflict,
    check_bucket_args, check_delta, check_expected_version, check_name, check_ttl_s,
    decode_record_data, encode_record_data,
)
from kvgate.state.quota import BucketGive, BucketTake, QuotaResult, Slot, decide_take


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Expiring(Generic[T]):
    value: T
    expires_at: float  # wall seconds; expired from this instant on


@dataclass(frozen=True, slots=True)
class _Bucket:
    tokens: float
    updated_at: float  # wall seconds of the last refill computation


@dataclass(frozen=True, slots=True)
class _Versioned:
    version: int
    encoded: str  # canonical JSON of the data


def take_from_bucket(
    bucket: _Bucket | None, now: float, capacity: float, refill_per_s: float, cost: float
) -> tuple[_Bucket, TokenBucketResult]:
    """The token-bucket arithmetic, pure. The Redis store's Lua script mirrors it line for line.

    Worked numbers: capacity 10, refill 2/s. A new bucket is full; taking 10 leaves 0. One more at
    the same instant is denied with retry after (1 - 0) / 2 = 0.5 s. Half a second later the bucket
    holds 1 token and the take is allowed, leaving 0.
    """
    tokens, updated_at = _refilled(bucket, now, capacity, refill_per_s)
    if cost > capacity:
        return _Bucket(tokens, updated_at), TokenBucketResult(False, tokens, math.inf)
    if tokens >= cost:
        tokens -= cost
        return _Bucket(tokens, updated_at), TokenBucketResult(True, tokens, 0.0)
    retry_after_s = math.inf if refill_per_s == 0 else (cost - tokens) / refill_per_s
    return _Bucket(tokens, updated_at), TokenBucketResult(False, tokens, retry_after_s)


def _refilled(bucket: _Bucket | None, now: float, capacity: float, refill_per_s: float) -> tuple[float, float]:
    """(tokens, updated_at) of `bucket` at `now`: a new bucket is full; refilled up to capacity."""
    if bucket is None:
        return capacity, now
    # Never refill for negative elapsed time: another host's clock may run slightly ahead.
    elapsed_s = max(0.0, now - bucket.updated_at)
    return min(capacity, bucket.tokens + elapsed_s * refill_per_s), max(bucket.updated_at, now)


def give_to_bucket(bucket: _Bucket | None, now: float, give: BucketGive) -> _Bucket:
    """`give.delta` added to the refilled bucket, kept within [give.floor, capacity] (`StateStore.return_quota`);
    the Redis store's script mirrors it. Capacity 10, 4 left: +3 -> 7, +9 -> 10, -30 with floor -10 -> -10."""
    tokens, updated_at = _refilled(bucket, now, give.capacity, give.refill_per_s)
    return _Bucket(max(give.floor, min(give.capacity, tokens + give.delta)), updated_at)


class MemoryStateStore:
    """A `StateStore` held in this process's memory. See `StateStore` for each method's contract."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._closed = False
        self._members: dict[str, _Expiring[MemberRecord]] = {}  # by replica_id
        self._counters: dict[str, _Expiring[int]] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._leases: dict[str, _Expiring[str]] = {}  # name -> holder
        self._records: dict[str, dict[str, _Versioned]] = {}  # collection -> id -> record
        self._member_listeners: list[Callable[[], None]] = []

    def _now(self) -> float:
        if self._closed:
            raise StateStoreUnavailable("the memory state store is closed")
        return self._clock.wall()

    @staticmethod
    def _live(entry: _Expiring[T] | None, now: float) -> _Expiring[T] | None:
        return entry if entry is not None and now < entry.expires_at else None

    # -- membership ------------------------------------------------------------------------------

    def on_member_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` when a member is added or changes state or address (not on heartbeats): in one process
        (`kvgate up`) the gateway reads membership at once instead of at its next poll. Redis has no such call;
        gateways there poll."""
        self._member_listeners.append(listener)

    async def put_member(self, record: MemberRecord, ttl_s: float) -> MemberRecord:
        check_name("replica_id", record.replica_id)
        check_ttl_s(ttl_s)
        now = self._now()
        stored = replace(record, updated_at=now)
        before = self._live(self._members.get(record.replica_id), now)
        self._members[record.replica_id] = _Expiring(stored, now + ttl_s)
        if before is None or replace(before.value, updated_at=now) != stored:
            for listener in self._member_listeners:
                listener()
        return stored

    async def remove_member(self, replica_id: str) -> bool:
        now = self._now()
        return self._live(self._members.pop(replica_id, None), now) is not None

    async def list_members(self, model: str | None = None) -> list[MemberRecord]:
        now = self._now()
        expired = [rid for rid, entry in self._members.items() if now >= entry.expires_at]
        for replica_id in expired:
            del self._members[replica_id]
        members = [e.value for e in self._members.values() if model is None or e.value.model == model]
        return sorted(members, key=lambda m: m.replica_id)

    # -- counters --------------------------------------------------------------------------------

    async def incr(self, key: str, delta: int = 1, *, ttl_s: float) -> int:
        check_name("key", key)
        check_delta(delta)
        check_ttl_s(ttl_s)
        now = self._now()
        live = self._live(self._counters.get(key), now)
        value = (live.value if live else 0) + delta
        self._counters[key] = _Expiring(value, now + ttl_s)
        return value

    async def get_counter(self, key: str) -> int:
        now = self._now()
        live = self._live(self._counters.get(key), now)
        if live is None:
            self._counters.pop(key, None)
            return 0
        return live.value

    # -- rate limiting ---------------------------------------------------------------------------

    async def take_tokens(
        self, key: str, capacity: float, refill_per_s: float, cost: float = 1.0
    ) -> TokenBucketResult:
        check_name("key", key)
        check_bucket_args(capacity, refill_per_s, cost)
        now = self._now()
        bucket, result = take_from_bucket(self._buckets.get(key), now, capacity, refill_per_s, cost)
        self._buckets[key] = bucket
        return result

    async def take_quota(self, slot: Slot | None, takes: Sequence[BucketTake]) -> QuotaResult:
        now = self._now()
        refilled = [_refilled(self._buckets.get(t.key), now, t.capacity, t.refill_per_s) for t in takes]
        live = self._live(self._counters.get(slot.key), now) if slot is not None else None
        in_flight = max(0, live.value) if live is not None else 0
        result = decide_take(in_flight, slot, [tokens for tokens, _ in refilled], takes)
        if result.allowed:
            if slot is not None:
                self._counters[slot.key] = _Expiring(in_flight + 1, now + slot.ttl_s)
            for take, level, (_, updated_at) in zip(takes, result.levels, refilled):
                self._buckets[take.key] = _Bucket(level, updated_at)
        return result

    async def return_quota(self, slot: Slot | None, give: BucketGive | None) -> None:
        now = self._now()
        if slot is not None:
            live = self._live(self._counters.get(slot.key), now)
            self._counters[slot.key] = _Expiring(max(0, (live.value if live else 0) - 1), now + slot.ttl_s)
        if give is not None:
            self._buckets[give.key] = give_to_bucket(self._buckets.get(give.key), now, give)

    # -- leases ----------------------------------------------------------------------------------

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        check_name("lease name", name)
        check_name("holder", holder)
        check_ttl_s(ttl_s)
        now = self._now()
        live = self._live(self._leases.get(name), now)
        if live is not None and live.value != holder:
            return False
        self._leases[name] = _Expiring(holder, now + ttl_s)
        return True

    async def release_lease(self, name: str, holder: str) -> bool:
        now = self._now()
        live = self._live(self._leases.get(name), now)
        if live is None or live.value != holder:
            return False
        del self._leases[name]
        return True

    async def lease_holder(self, name: str) -> str | None:
        live = self._live(self._leases.get(name), self._now())
        return None if live is None else live.value

    # -- durable records -------------------------------------------------------------------------

    async def put_record(
        self,
        collection: str,
        record_id: str,
        data: Mapping[str, JSONValue],
        expected_version: int | None = None,
    ) -> int:
        check_name("collection", collection)
        check_name("record_id", record_id)
        check_expected_version(expected_version)
        encoded = encode_record_data(data)
        self._now()
        records = self._records.setdefault(collection, {})
        current = records.get(record_id)
        current_version = current.version if current else 0
        if expected_version is not None and expected_version != current_version:
            raise VersionConflict(collection, record_id, expected_version, current_version)
        records[record_id] = _Versioned(current_version + 1, encoded)
        return current_version + 1

    async def get_record(self, collection: str, record_id: str) -> StoredRecord | None:
        self._now()
        current = self._records.get(collection, {}).get(record_id)
        if current is None:
            return None
        return StoredRecord(collection, record_id, current.version, decode_record_data(current.encoded))

    async def delete_record(
        self, collection: str, record_id: str, expected_version: int | None = None
    ) -> bool:
        check_expected_version(expected_version)
        self._now()
        records = self._records.get(collection, {})
        current = records.get(record_id)
        current_version = current.version if current else 0
        if expected_version is not None and expected_version != current_version:
            raise VersionConflict(collection, record_id, expected_version, current_version)
        if current is None:
            return False
        del records[record_id]
        return True

    async def list_records(self, collection: str) -> list[StoredRecord]:
        self._now()
        records = self._records.get(collection, {})
        return [
            StoredRecord(collection, rid, rec.version, decode_record_data(rec.encoded))
            for rid, rec in sorted(records.items())
        ]

    async def close(self) -> None:
        self._closed = True
