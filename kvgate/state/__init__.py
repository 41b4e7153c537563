"""kvgate's state store: membership, counters, token buckets, leases and durable records.

`StateStore` (in `base`) is the interface; `MemoryStateStore` serves one process and
`RedisStateStore` many. `open_state_store` picks one from a URL, for the composition root.
The records that processes exchange through it are typed once: `MemberRecord` (in `base`), the
observations and the autoscaler's status (in `records`), all versioned as `schema` says.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvgate.clock import Clock
from kvgate.state.base import (
    MemberRecord,
    ReplicaState,
    StateStore,
    StateStoreError,
    StateStoreUnavailable,
    StoredRecord,
    TokenBucketResult,
    VersionConflict,
)
from kvgate.state.memory import MemoryStateStore
from kvgate.state.records import AutoscalerStatus, ObservationRecord
from kvgate.state.redis_store import RedisStateStore, redact_url
from kvgate.state.schema import NewerSchema, SkippedRecords

__all__ = [
    "REDIS_PASSWORD_ENV",
    "AutoscalerStatus",
    "MemberRecord",
    "MemoryStateStore",
    "NewerSchema",
    "ObservationRecord",
    "RedisStateStore",
    "ReplicaState",
    "SkippedRecords",
    "StateStore",
    "StateStoreError",
    "StateStoreUnavailable",
    "StoredRecord",
    "TokenBucketResult",
    "VersionConflict",
    "open_state_store",
    "redact_url",
]

_SCHEMES = ("memory", "redis", "rediss")


# The environment variable a Redis password may come from instead of the URL, so that it stays out of the
# process's arguments (which `ps` shows to anyone in the container); the commands read it, the Helm chart sets it.
REDIS_PASSWORD_ENV = "KVGATE_REDIS_PASSWORD"


def open_state_store(url: str, clock: Clock, *, prefix: str = "kvgate:", password: str | None = None) -> StateStore:
    """A store for `url`: "memory://" (this process only), or "redis://host:port/db" /
    "rediss://..." (shared; `prefix` namespaces the keys so several clusters can share one Redis).
    `password` authenticates to a Redis whose URL carries none (one in the URL wins).

    Does no I/O: an unreachable Redis shows up as `StateStoreUnavailable` on first use.
    Raises ValueError for any other scheme, naming the allowed ones.
    """
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryStateStore(clock)
    if scheme in ("redis", "rediss"):
        return RedisStateStore.from_url(url, clock, prefix=prefix, password=password)
    allowed = ", ".join(f"{s}://" for s in _SCHEMES)
    raise ValueError(f"state store URL {url!r}: unknown scheme {scheme!r}; allowed: {allowed}")
