"""Node claims as durable, versioned records: what makes buying nodes crash-safe.

The protocol (the reconciler follows it; the crash tests in tests/autoscaler/test_reconciler_crash.py
kill the loop at each arrow):

    write claim PENDING (expected_version 0)  ->  provider.create(claim)  ->  mark CONFIRMED(node_id)
    mark DELETING                             ->  provider.delete(node)   ->  remove the claim record

A claim record exists before any money is spent, and is removed only after the node is gone, so a
node kvgate bought always has a claim (or is an orphan that recovery releases). Writing a new claim
with expected_version 0 means the same claim id can never be written twice, and `create` is
idempotent on the claim id, so re-driving a PENDING claim after a crash buys at most one node.

Collection "claims", record id = the claim id. Data:
    {"schema_version": 1, "claim_id", "phase": "pending"|"confirmed"|"deleting", "claim": {...the NodeClaim as
     JSON...}, "node_id": str|null, "created_at": wall s, "updated_at": wall s, "holder": autoscaler id}

`schema_version` follows `kvgate.state.schema`'s rules. A claim this release cannot read (written by a newer
release during a rolling upgrade, or damaged) is still a claim: its node is neither released nor adopted while
the record is there (`ClaimsRead.unreadable`). The record stays a `providers` value (a `NodeClaim` inside), so it
is defined here rather than in `kvgate/state`, which may not import providers.

A store can lose every record at once: a Redis without persistence restarted empty, a new Redis, a changed
--key-prefix, an evicted key. Then every node kvgate runs looks like an orphan, and releasing them would stop
a whole serving fleet to buy it again. The ledger record (id "~ledger" in the same "claims" collection, written
once the claims have been reconciled against every pool) tells the two cases apart: while it is there, a
tagged node without a claim was bought behind kvgate's back and is released; when it is missing, the claims
were lost, not the nodes, and each tagged node is adopted with a CONFIRMED claim rebuilt from its tags
(`claim_of_node`). It shares the claims' collection (one Redis hash) so that the two are read in one go and
can only be lost together: a ledger that outlived its claims would release the fleet.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvgate.state import StateStore, StoredRecord, VersionConflict
from kvgate.state.schema import SCHEMA_KEY, NewerSchema, SkippedRecords, check_schema
from kvgate.providers.base import CapacityType, Node, NodeClaim, OfferingKey, ReplicaSpec

log = logging.getLogger("kvgate.autoscaler")

CLAIMS = "claims"
LEDGER_ID = "~ledger"  # the ledger record, in the claims collection (module docstring); no claim id starts with ~
CLAIM_SCHEMA = 1  # the major schema version of claim records this release writes and reads


class ClaimPhase(enum.StrEnum):
    PENDING = "pending"  # written, the provider may or may not have been called
    CONFIRMED = "confirmed"  # the provider returned a node for it
    DELETING = "deleting"  # its node is being released


class ClaimConflict(Exception):
    """Somebody else changed the claim record since it was read (a second autoscaler whose lease
    overlapped, or an operator). The caller drops its view and re-reads on the next tick."""


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """One claim as stored, with the version needed for the next conditional write."""

    claim_id: str
    phase: ClaimPhase
    claim: NodeClaim  # what to buy: enough to re-drive create after a crash
    node_id: str | None
    created_at: float
    updated_at: float
    holder: str
    version: int

    def to_json(self) -> dict[str, Any]:
        return {SCHEMA_KEY: CLAIM_SCHEMA, "claim_id": self.claim_id, "phase": self.phase.value, "claim": claim_to_json(self.claim),
                "node_id": self.node_id, "created_at": self.created_at, "updated_at": self.updated_at,
                "holder": self.holder}

    @classmethod
    def from_stored(cls, stored: StoredRecord) -> ClaimRecord:
        data = stored.data
        check_schema(data, "claim", CLAIM_SCHEMA)
        return cls(claim_id=data["claim_id"], phase=ClaimPhase(data["phase"]), claim=claim_from_json(data["claim"]),
                   node_id=data.get("node_id"), created_at=float(data["created_at"]),
                   updated_at=float(data["updated_at"]), holder=str(data.get("holder", "")),
                   version=stored.version)


@dataclass(frozen=True)
class ClaimsRead:
    """One read of the claims collection."""

    claims: tuple[ClaimRecord, ...]  # sorted by id
    ledger_kept: bool  # the store has kept its claims since an autoscaler reconciled them (module docstring)
    unreadable: frozenset[str] = frozenset()  # ids of claim records this release cannot read: hands off their nodes


class ClaimStore:
    """Conditional reads and writes of claim records. Every method may raise `StateStoreUnavailable`;
    writes raise `ClaimConflict` when the record changed under the caller."""

    def __init__(self, store: StateStore, holder: str, skipped: SkippedRecords | None = None) -> None:
        self._store = store
        self._holder = holder
        self._skipped = skipped or SkippedRecords(log)

    async def list(self) -> list[ClaimRecord]:
        """Every claim, sorted by id. A record that does not parse is skipped (and left alone)."""
        return list((await self.read()).claims)

    async def read(self) -> ClaimsRead:
        """Every claim, whether the ledger record is there, and which claim records could not be read, from one
        read of the collection."""
        claims, ledger_kept, unreadable = [], False, set()
        for stored in await self._store.list_records(CLAIMS):
            if stored.id == LEDGER_ID:
                ledger_kept = True
                continue
            try:
                claims.append(ClaimRecord.from_stored(stored))
            except NewerSchema as exc:
                self._skipped.newer(CLAIMS, stored.id, exc)
                unreadable.add(stored.id)
            except (KeyError, TypeError, ValueError):
                unreadable.add(stored.id)
        return ClaimsRead(tuple(claims), ledger_kept, frozenset(unreadable))  # list_records sorts by id

    async def keep_ledger(self, now_wall_s: float) -> None:
        """Write the ledger record unless it is there (idempotent; a concurrent writer is fine)."""
        data = {SCHEMA_KEY: CLAIM_SCHEMA, "kept_since": now_wall_s, "holder": self._holder}
        try:
            await self._store.put_record(CLAIMS, LEDGER_ID, data, expected_version=0)
        except VersionConflict:
            pass  # another autoscaler wrote it first: the same fact

    async def write_confirmed(self, node: Node, now_wall_s: float) -> ClaimRecord:
        """A CONFIRMED claim for a running node whose claim the store lost (`claim_of_node`). Raises
        `ClaimConflict` if a claim with its id exists meanwhile."""
        record = ClaimRecord(node.claim_id, ClaimPhase.CONFIRMED, claim_of_node(node), node.id, now_wall_s,
                             now_wall_s, self._holder, 0)
        return await self._write(record, expected_version=0)

    async def write_pending(self, claim: NodeClaim, now_wall_s: float) -> ClaimRecord:
        """Write a new PENDING claim. Raises `ClaimConflict` if a claim with this id exists: a claim
        id is bought at most once."""
        record = ClaimRecord(claim.id, ClaimPhase.PENDING, claim, None, now_wall_s, now_wall_s, self._holder, 0)
        return await self._write(record, expected_version=0)

    async def confirm(self, record: ClaimRecord, node_id: str, now_wall_s: float) -> ClaimRecord:
        """PENDING -> CONFIRMED with the node the provider returned."""
        updated = replace(record, phase=ClaimPhase.CONFIRMED, node_id=node_id, updated_at=now_wall_s)
        return await self._write(updated, expected_version=record.version)

    async def mark_deleting(self, record: ClaimRecord, now_wall_s: float) -> ClaimRecord:
        """Any phase -> DELETING, before the provider is asked to delete the node."""
        updated = replace(record, phase=ClaimPhase.DELETING, updated_at=now_wall_s)
        return await self._write(updated, expected_version=record.version)

    async def remove(self, record: ClaimRecord) -> None:
        """Delete the record (its node is gone). Absent already is fine; changed is a conflict."""
        try:
            await self._store.delete_record(CLAIMS, record.claim_id, expected_version=record.version)
        except VersionConflict as exc:
            if exc.current_version != 0:
                raise ClaimConflict(str(exc)) from exc

    async def _write(self, record: ClaimRecord, expected_version: int) -> ClaimRecord:
        data = {**record.to_json(), "holder": self._holder}
        try:
            version = await self._store.put_record(CLAIMS, record.claim_id, data, expected_version)
        except VersionConflict as exc:
            raise ClaimConflict(str(exc)) from exc
        return replace(record, holder=self._holder, version=version)



def claim_of_node(node: Node) -> NodeClaim:
    """The claim a node was bought for, as far as its tags and offering tell: id, offering and model. Enough
    to keep it (a CONFIRMED claim is never re-driven), not to buy it again: `replica` is unknown."""
    offering = OfferingKey(pool=node.pool, instance_type=node.instance_type, capacity_type=node.capacity_type,
                           zone=node.zone)
    return NodeClaim(id=node.claim_id, offering=offering, model=node.model)


def claim_to_json(claim: NodeClaim) -> dict[str, Any]:
    """A NodeClaim as plain JSON (the inverse of `claim_from_json`)."""
    key = claim.offering
    replica = claim.replica
    return {
        "id": claim.id,
        "offering": {"pool": key.pool, "instance_type": key.instance_type,
                     "capacity_type": key.capacity_type.value, "zone": key.zone},
        "model": claim.model,
        "replica": None if replica is None else {
            name: (list(map(list, value)) if name == "adapters" else value)
            for name in ReplicaSpec.__slots__ for value in (getattr(replica, name),)},
        "labels": dict(claim.labels),
    }


def claim_from_json(raw: Mapping[str, Any]) -> NodeClaim:
    """The NodeClaim written by `claim_to_json`; raises KeyError/ValueError/TypeError when malformed."""
    offering = raw["offering"]
    key = OfferingKey(pool=offering["pool"], instance_type=offering["instance_type"],
                      capacity_type=CapacityType(offering["capacity_type"]), zone=offering.get("zone", ""))
    replica_raw = raw.get("replica")
    replica = None
    if replica_raw is not None:
        fields = dict(replica_raw)
        fields["adapters"] = tuple(tuple(pair) for pair in fields.get("adapters", ()))
        replica = ReplicaSpec(**fields)
    return NodeClaim(id=raw["id"], offering=key, model=raw.get("model"), replica=replica,
                     labels=dict(raw.get("labels", {})))
