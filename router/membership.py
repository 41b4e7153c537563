"""Which replicas the gateway tracks, decided from the registry and the state store's members: pure.

Two sources say a replica exists. The registry's static replicas (always READY) change on a reload; the
membership records the autoscaler publishes (id = the record's replica_id, "kvg-...") change on every poll.
`ReplicaTracker` reads both, asks these functions what to do, and does it.

A replica's id is public: the `x-kvgate-replica` header of every answer, the `replica` label of the metrics
and `/admin/stats` show it. Its URL is not: it may carry credentials (`http://user:password@host`) and names
an internal address. A static replica's id is "<model>-static-<n>", its place in the model's list
(`static_replica_id`); operators see its URL only through `public_url`.

Membership is eventually consistent, and the data path must outlive the control path. A member that
leaves the list while READY (its heartbeat lapsed: the autoscaler crashed, restarts, fails over to a
standby after the lease TTL, or Redis restarted empty) stays tracked, and routable whenever it is, for up
to `member_grace_s` or until it is listed again; Envoy treats hosts that leave service discovery the same
way. It is dropped sooner after UNLISTED_DROP_AFTER_CHECKS failed health checks in a row (a replica that
is gone). A member that leaves while STARTING or DRAINING is dropped at once: the autoscaler marks a
replica DRAINING before it stops it on scale-down, and publishes one it takes out for good without a
drain (a replica that failed, a preempted or deleted node) DRAINING once more and lets that record lapse.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvgate.registry.schema import Backend
from kvgate.registry.snapshot import Snapshot
from kvgate.state.base import MemberRecord
from kvgate.state.base import ReplicaState as MemberState

DEFAULT_BLOCK_SIZE_TOKENS = 16
# A member kept after its membership record lapsed is dropped after this many failed health checks in a row
# (~6 s at the default 2 s interval): one slow check, under load, must not drop a replica nothing re-adds.
UNLISTED_DROP_AFTER_CHECKS = 3


@dataclass(frozen=True)
class ReplicaSource:
    """One replica as its source declares it: a registry static replica or a membership record."""

    replica_id: str  # public (see the module docstring)
    model: str
    url: str = field(repr=False)  # may hold credentials: shown only as `public_url`
    backend: Backend
    grpc_target: str | None  # a kvgate engine's state stream; None: scraped (or, for openai, not read)
    member_state: MemberState | None  # None: a static replica from the registry
    api_key_env: str | None = None  # static replicas: the gateway's variable that holds its API key

    @property
    def readers_key(self) -> tuple[str, Backend, str | None]:
        """What a replica's load readers are started for; a change restarts them."""
        return (self.url, self.backend, self.grpc_target)


def static_replica_id(model: str, index: int) -> str:
    """The public id of the model's `index`-th static replica (from 0): "chat-static-0".

    The same in every gateway and after a restart, so that N gateways label one replica alike, and free of
    anything secret or internal. Not a hash of the URL: a hash of "model + http://10.0.0.5:8000" is found by
    trying the 2^24 addresses of 10.0.0.0/8 in a second, and with `user:password@` in the URL it would let
    anyone test password guesses offline. The cost: removing or reordering the registry's entries renames those
    after them (their records, indexes and metric series start again). Model names are DNS labels, so the id
    is a valid header value and label; a member's "kvg-..." id has no "-static-<n>" tail to clash with."""
    return f"{model}-static-{index}"


def static_sources(snapshot: Snapshot) -> dict[str, ReplicaSource]:
    """Every static replica the registry declares, by id (`static_replica_id`). A URL listed twice for one
    model is tracked once, under its first place."""
    sources: dict[str, ReplicaSource] = {}
    for name, doc in snapshot.models.items():
        seen: set[str] = set()
        for index, static in enumerate(doc.spec.routing.static_replicas):
            if static.url not in seen:
                seen.add(static.url)
                replica_id = static_replica_id(name, index)
                sources[replica_id] = ReplicaSource(replica_id, name, static.url, static.backend, static.grpc_target,
                                                    None, static.api_key_env)
    return sources


def public_url(url: str) -> str:
    """`url` fit for an operator's page and a log line: without its user part and its query, which may hold
    credentials ("user:password@", "?api_key=..."), and its fragment. The path stays: it tells apart two
    servers behind one host. "http://u:s3cret@10.0.0.5:8000/v1?key=k" -> "http://10.0.0.5:8000/v1".

    The user part is everything up to the last "@", as in `kvgate.state.redact_url`, so a password holding
    an unencoded "/", "?" or "#" is dropped whole, where urlsplit would take part of it for the path. (An "@"
    in a path or query then costs the host, never a secret.)"""
    scheme, sep, rest = url.partition("://") if "://" in url else ("", "", url)
    return scheme + sep + rest.rpartition("@")[2].partition("?")[0].partition("#")[0]


def member_sources(records: Iterable[MemberRecord]) -> list[ReplicaSource]:
    """The listed members: a record with a gRPC target is a kvgate engine, one without serves /metrics. URLs lose
    a trailing slash, as the registry's static ones do, so a record compares equal to what is tracked from it."""
    return [ReplicaSource(r.replica_id, r.model, r.url.rstrip("/"), Backend.KVGATE if r.grpc_target else Backend.VLLM,
                          r.grpc_target, r.state) for r in records]


class Upsert(enum.Enum):
    """What tracking `wanted` takes, given what is tracked under its id."""

    ADD = "add"  # nothing tracked: a new record, its index and readers
    REPLACE = "replace"  # another URL, backend, gRPC target or model: drop the old record, then add
    STATE = "state"  # only its membership state changed
    KEEP = "keep"  # nothing changed


def upsert(current: ReplicaSource | None, wanted: ReplicaSource) -> Upsert:
    """How to bring the replica tracked as `current` (None: none) to `wanted`; `api_key_env` is not compared."""
    if current is None:
        return Upsert.ADD
    if current.readers_key != wanted.readers_key or current.model != wanted.model:
        return Upsert.REPLACE
    return Upsert.STATE if current.member_state != wanted.member_state else Upsert.KEEP


@dataclass(frozen=True)
class Standing:
    """What decides whether a member missing from the membership list stays tracked."""

    member_state: MemberState | None
    draining: bool  # by its membership state or by its own stream
    failed_checks: int  # health checks failed in a row
    unlisted_since: float | None  # clock seconds; None: it was listed at the last poll that worked

    @property
    def serving(self) -> bool:
        """READY, not draining, and answering its health checks well enough to be kept unlisted."""
        return (self.member_state is MemberState.READY and not self.draining
                and self.failed_checks < UNLISTED_DROP_AFTER_CHECKS)

    @property
    def gone(self) -> bool:
        """Kept unlisted, and it has stopped answering: drop it without waiting for the next poll."""
        return self.unlisted_since is not None and self.failed_checks >= UNLISTED_DROP_AFTER_CHECKS


class Unlisted(enum.Enum):
    """What to do with a member missing from the membership list."""

    START_GRACE = "start_grace"  # it was serving: keep it, unlisted from now
    KEEP = "keep"  # still in its grace
    DROP = "drop"


def judge_unlisted(standing: Standing, now: float, grace_s: float) -> Unlisted:
    """Keep a member that left the list while serving, for up to `grace_s` after it left; drop it otherwise.
    Left at t=100 with 600 s of grace: kept at t=699, dropped at t=700, or at the first poll after it stops
    serving. No grace (0 s): dropped at once."""
    if not standing.serving:
        return Unlisted.DROP
    if standing.unlisted_since is None:
        return Unlisted.START_GRACE if grace_s > 0 else Unlisted.DROP
    return Unlisted.KEEP if now - standing.unlisted_since < grace_s else Unlisted.DROP


def drop_reason(standing: Standing) -> str:
    """Why a member kept unlisted is dropped, for the log line."""
    if standing.serving:
        return "grace over"
    if standing.draining:
        return "draining"
    return f"{standing.failed_checks} failed health checks in a row"


@dataclass(frozen=True)
class ModelKnobs:
    """What a replica's record takes from its model's registry document."""

    block_size_tokens: int
    max_loaded_adapters: int
    prefix_chunk_chars: int  # routing.prefix_chunk_chars: the cut its prefix index counts in
    holds_places: bool = False  # routing.fair_queueing: requests go to a replica with a place free (view.places)
    places_per_replica: int | None = None  # routing.max_in_flight_per_replica; None: learned (router.capacity)


def model_knobs(snapshot: Snapshot | None, model: str, default_chunk_chars: int) -> ModelKnobs:
    """The model's knobs, or the defaults for a model the registry does not (or no longer) declare."""
    doc = snapshot.models.get(model) if snapshot is not None else None
    if doc is None:
        return ModelKnobs(DEFAULT_BLOCK_SIZE_TOKENS, 0, default_chunk_chars)
    routing = doc.spec.routing
    return ModelKnobs(doc.spec.engine.block_size_tokens, doc.spec.engine.max_loaded_adapters,
                      routing.prefix_chunk_chars, routing.fair_queueing, routing.max_in_flight_per_replica)
