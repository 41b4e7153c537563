"""The state store interface: what gateways and the autoscaler share, and the value types they share.

Two implementations satisfy `StateStore`: `MemoryStateStore` (one process, the embedded default) and
`RedisStateStore` (N gateways plus one autoscaler on different hosts). The test suite in
`tests/state/` runs the same specification against both.

Time. Every expiry and every token-bucket refill is logical: it is computed from the injected clock's
`wall()` (seconds since the Unix epoch), never from Redis's own clock or key TTLs. Wall time, not
`now()`, because records are read and written by processes on different hosts, whose monotonic
timelines have unrelated origins. A record written at wall time W with ttl T is live while
`wall() < W + T` and expired from `wall() >= W + T` on. Hosts are expected to run NTP; skew between
them shortens or lengthens a ttl by the skew.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from kvgate.state.schema import SCHEMA_KEY, check_schema

if TYPE_CHECKING:
    from kvgate.state.quota import BucketGive, BucketTake, QuotaResult, Slot

# A JSON value as the record store accepts it. Mappings must have str keys; floats must be finite.
JSONValue = Any


def raise_if_cancelled() -> None:
    """Raise CancelledError when the current task was asked to stop. A store call can swallow a cancellation
    that lands while it waits on Redis (redis-py's read timeout under Python 3.11's asyncio.timeout): a loop
    that then goes back to sleep would never end, and whoever awaits its cancelled task would wait forever (a
    gateway's shutdown did, on a fake clock). Loops call this after each store call."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class StateStoreError(Exception):
    """Base of every error a state store raises on purpose (invalid arguments raise ValueError)."""


class StateStoreUnavailable(StateStoreError):
    """The backing service cannot be reached (connection refused, timeout) or the store is closed.

    Callers treat this as transient: retry later, or degrade (a gateway routes on local state only).
    """


class VersionConflict(StateStoreError):
    """A conditional write or delete found a different version than the caller expected.

    `current_version` is what the store holds now; 0 means the record does not exist.
    """

    def __init__(
        self, collection: str, record_id: str, expected_version: int, current_version: int
    ) -> None:
        self.collection = collection
        self.record_id = record_id
        self.expected_version = expected_version
        self.current_version = current_version
        super().__init__(
            f"record {collection}/{record_id}: expected version {expected_version}, "
            f"found {current_version}" + (" (absent)" if current_version == 0 else "")
        )


class ReplicaState(enum.StrEnum):
    """Where a replica is in its life, as routers see it."""

    STARTING = "starting"  # process up, model loading; not routable yet
    READY = "ready"  # takes new requests
    DRAINING = "draining"  # finishing in-flight requests; takes no new ones


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """One replica as published by the autoscaler (or the replica itself) and watched by routers.
    Versioned as `schema` says (a newer major raises `NewerSchema` from `from_json`)."""

    SCHEMA_VERSION: ClassVar[int] = 1

    replica_id: str
    model: str
    url: str  # base URL of the replica's OpenAI-compatible HTTP API
    grpc_target: str | None = None  # host:port of its ReplicaState stream; None for foreign backends
    state: ReplicaState = ReplicaState.STARTING
    node_id: str | None = None  # the node it runs on, so node-level scaling can find its replicas
    pool: str | None = None  # the registry Pool the node was bought from
    updated_at: float = 0.0  # wall seconds of the last put_member; set by the store, ignored on input

    def __post_init__(self) -> None:
        # Accept "ready" as well as ReplicaState.READY, so records built from config or JSON compare
        # equal to the stored ones; an unknown state raises ValueError here, not in a reader.
        object.__setattr__(self, "state", ReplicaState(self.state))

    def to_json(self) -> dict[str, Any]:
        return {
            SCHEMA_KEY: self.SCHEMA_VERSION,
            "replica_id": self.replica_id,
            "model": self.model,
            "url": self.url,
            "grpc_target": self.grpc_target,
            "state": self.state.value,
            "node_id": self.node_id,
            "pool": self.pool,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> MemberRecord:
        check_schema(raw, "member", cls.SCHEMA_VERSION)
        return cls(
            replica_id=raw["replica_id"],
            model=raw["model"],
            url=raw["url"],
            grpc_target=raw.get("grpc_target"),
            state=ReplicaState(raw["state"]),
            node_id=raw.get("node_id"),
            pool=raw.get("pool"),
            updated_at=float(raw["updated_at"]),
        )


@dataclass(frozen=True, slots=True)
class TokenBucketResult:
    """The answer of one `take_tokens` call."""

    allowed: bool
    remaining: float  # tokens left after this call (after the take when allowed)
    retry_after_s: float  # 0 when allowed; math.inf when the cost can never be met (cost > capacity)


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """A durable record as read back from the store. `data` is deeply immutable: mappings are
    `MappingProxyType`, lists are tuples; it is a fresh copy, never shared with the store."""

    collection: str
    id: str
    version: int  # 1 after the first write, +1 per write
    data: Mapping[str, JSONValue]


@runtime_checkable
class StateStore(Protocol):
    """State shared between gateways and the autoscaler. All methods are coroutines.

    Every method may raise `StateStoreUnavailable` (backend unreachable, or the store was closed);
    invalid arguments (ttl <= 0, empty names, non-JSON data) raise `ValueError` before any I/O.
    """

    # -- membership ------------------------------------------------------------------------------

    async def put_member(self, record: MemberRecord, ttl_s: float) -> MemberRecord:
        """Upsert `record` (keyed by replica_id) live for `ttl_s` from now; return it as stored, with
        `updated_at` set to the clock's wall time. Idempotent; each call is a heartbeat that pushes
        expiry to now + ttl_s."""
        ...

    async def remove_member(self, replica_id: str) -> bool:
        """Delete the member. Returns whether a live one was there; succeeds when it is absent."""
        ...

    async def list_members(self, model: str | None = None) -> list[MemberRecord]:
        """Live members (of `model` when given), sorted by replica_id. Expired ones are excluded
        and deleted on the way."""
        ...

    # -- counters --------------------------------------------------------------------------------

    async def incr(self, key: str, delta: int = 1, *, ttl_s: float) -> int:
        """Add `delta` (may be negative) and return the new value. The counter expires `ttl_s` after
        its last change; an expired counter counts as 0, so the delta applies to 0. Values may go
        below zero (a decrement after expiry); callers that count in-flight requests clamp."""
        ...

    async def get_counter(self, key: str) -> int:
        """The counter's value; 0 if it never existed or has expired."""
        ...

    # -- rate limiting ---------------------------------------------------------------------------

    async def take_tokens(
        self, key: str, capacity: float, refill_per_s: float, cost: float = 1.0
    ) -> TokenBucketResult:
        """Atomically take `cost` tokens from the bucket `key` if it holds that many.

        A bucket starts full (`capacity` tokens) and refills at `refill_per_s` tokens per wall
        second up to `capacity`. When denied nothing is taken and `retry_after_s` says when the
        cost will be available (math.inf when refill_per_s is 0). A cost above capacity is never
        allowed: the answer is denied with retry_after_s = math.inf (callers answer 413/400, not
        429). Capacity and rate travel with each call, so a config reload applies at once (a
        bucket above a lowered capacity is cut down to it). Raises ValueError for capacity <= 0,
        refill_per_s < 0 or cost <= 0."""
        ...

    async def take_quota(self, slot: Slot | None, takes: Sequence[BucketTake]) -> QuotaResult:
        """Atomically count one more in the in-flight counter `slot` (if given) and take each of `takes` from
        its bucket, all or nothing: when the slot is full or a bucket holds too little, nothing changes and the
        result names what refused (`quota.decide_take`). Buckets refill as in `take_tokens`. On Redis the keys
        must share one hash slot (put a `{tag}` in them) for Redis Cluster."""
        ...

    async def return_quota(self, slot: Slot | None, give: BucketGive | None) -> None:
        """Atomically count one out of the in-flight counter `slot` (never below 0: a counter that lapsed while
        its request ran stays at 0) and add `give.delta` to its bucket within [give.floor, capacity]. Worked
        numbers: capacity 100 with 30 left: +50 -> 80; +90 -> 100; -180 with floor -100 -> -100."""
        ...

    # -- leases ----------------------------------------------------------------------------------

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take the lease if it is free or expired, or renew it (expiry = now + ttl_s) if `holder`
        already holds it. False if another holder's lease is live. Atomic across processes."""
        ...

    async def release_lease(self, name: str, holder: str) -> bool:
        """Release the lease if `holder` holds it and it is live; True then. False (and no change)
        when another holds it, nobody does, or it has expired."""
        ...

    async def lease_holder(self, name: str) -> str | None:
        """The holder of the live lease, or None."""
        ...

    # -- durable records -------------------------------------------------------------------------

    async def put_record(
        self,
        collection: str,
        record_id: str,
        data: Mapping[str, JSONValue],
        expected_version: int | None = None,
    ) -> int:
        """Write `data` and return the new version (1 for a new record, then +1 per write).

        expected_version None writes unconditionally; 0 requires that the record does not exist;
        N >= 1 requires it to be at version N. A mismatch raises `VersionConflict` and writes
        nothing. `data` must be JSON-serialisable (str keys, finite floats) else ValueError; it is
        copied, so later changes to the caller's object do not reach the store. Records never
        expire."""
        ...

    async def get_record(self, collection: str, record_id: str) -> StoredRecord | None:
        """The record, or None if absent."""
        ...

    async def delete_record(
        self, collection: str, record_id: str, expected_version: int | None = None
    ) -> bool:
        """Delete the record; True if it existed. With `expected_version` set, a mismatch raises
        `VersionConflict` (0 means "expect absent": absent gives False, present conflicts).
        Deleting an absent record without an expected version returns False."""
        ...

    async def list_records(self, collection: str) -> list[StoredRecord]:
        """Every record in the collection, sorted by id."""
        ...

    async def close(self) -> None:
        """Release connections. Idempotent. Later calls raise `StateStoreUnavailable`."""
        ...


# -- helpers shared by the implementations ----------------------------------------------------------


def check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")


def check_ttl_s(ttl_s: float) -> None:
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")


def check_delta(delta: int) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise ValueError(f"delta must be an int, got {delta!r}")


def check_expected_version(expected_version: int | None) -> None:
    if expected_version is None:
        return
    if isinstance(expected_version, bool) or not isinstance(expected_version, int):
        raise ValueError(f"expected_version must be None or an int >= 0, got {expected_version!r}")
    if expected_version < 0:
        raise ValueError(f"expected_version must be None or an int >= 0, got {expected_version}")


def check_bucket_args(capacity: float, refill_per_s: float, cost: float) -> None:
    if not (math.isfinite(capacity) and capacity > 0):
        raise ValueError(f"capacity must be a finite number > 0, got {capacity!r}")
    if not (math.isfinite(refill_per_s) and refill_per_s >= 0):
        raise ValueError(f"refill_per_s must be a finite number >= 0, got {refill_per_s!r}")
    if not (math.isfinite(cost) and cost > 0):
        raise ValueError(f"cost must be a finite number > 0, got {cost!r}")


def _plain(value: Any) -> Any:
    # json.dumps knows dict and list; frozen data read back from the store (MappingProxyType) must
    # be writable again as it is, so any Mapping is accepted.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def encode_record_data(data: Mapping[str, JSONValue]) -> str:
    """Canonical JSON of record data (sorted keys), raising ValueError if it is not JSON."""
    if not isinstance(data, Mapping):
        raise ValueError(f"record data must be a mapping, got {type(data).__name__}")
    try:
        return json.dumps(data, default=_plain, sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"record data is not JSON-serialisable: {err}") from err


def freeze_json(value: JSONValue) -> JSONValue:
    """Deeply immutable view of decoded JSON: dict -> MappingProxyType, list -> tuple."""
    if isinstance(value, dict):
        return types.MappingProxyType({k: freeze_json(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(freeze_json(v) for v in value)
    return value


def decode_record_data(encoded: str) -> Mapping[str, JSONValue]:
    return freeze_json(json.loads(encoded))
