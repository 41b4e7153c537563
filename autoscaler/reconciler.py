"""The node-level actuator: buys and releases nodes through the providers, crash-safely.

It follows the claim protocol of `autoscaler.claims`:

    create:  write claim PENDING -> provider.create(claim) -> mark CONFIRMED(node_id)
    delete:  mark claim DELETING -> provider.delete(node_id) -> remove the claim record

and `reconcile()` (run on start-up and then every tick: level-triggered, so a crash at any arrow is
repaired by the next call, whoever makes it) compares what the providers list with the claims:

| node listed (tagged for us) | claim                 | action                                              |
|-----------------------------|-----------------------|-----------------------------------------------------|
| yes                         | none, ledger kept     | orphan: delete the node (nobody tracks it)          |
| yes                         | none, no ledger       | the store lost its claims: adopt (claim CONFIRMED)  |
| yes                         | PENDING               | adopt: confirm the claim with the node's id         |
| yes                         | CONFIRMED             | owned: nothing to do                                |
| yes                         | DELETING              | re-drive the delete, then remove the claim          |
| no                          | PENDING               | re-drive create (idempotent on the claim id)        |
| no                          | CONFIRMED             | gone (terminated outside us): remove the claim      |
| no                          | DELETING              | done: remove the claim                              |

Order matters: nodes are listed BEFORE claims are read. A claim is written before its node is
bought, so every node in the list had its claim written before the claims were read, and a node is
never taken for an orphan because its claim was written between the two reads. The ledger record
(`autoscaler.claims`) is read with the claims in one read, so the two can only be seen, or lost, together,
and written at the end of a round that listed every pool, so a node in a pool that could not be listed is
adopted in a later round rather than released. Adopting where releasing was meant costs
at most the planner's empty-node grace for a node nothing runs on; releasing where adopting was meant
(Redis restarted empty) would stop every replica of the fleet.

A pool whose provider cannot be reached this round is left alone entirely (nothing is released
or re-driven on partial information). The fault hook lets tests kill the loop at each arrow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.autoscaler.claims import ClaimConflict, ClaimPhase, ClaimRecord, ClaimStore
from kvgate.autoscaler.status import Event, EventKind
from kvgate.clock import Clock
from kvgate.providers.base import (
    InsufficientCapacity,
    Node,
    NodeClaim,
    NodeState,
    Provider,
    ProviderError,
    ReplicaHandle,
)

log = logging.getLogger("kvgate.autoscaler")

# Fault points, in protocol order. A test's hook raises at one of them to "kill the process" there.
CLAIM_WRITTEN = "claim_written"  # claim PENDING is stored; the provider has not been called
PROVIDER_CALLED = "provider_called"  # create returned a node; the claim is still PENDING
DELETE_MARKED = "delete_marked"  # claim DELETING is stored; the provider has not been asked to delete
NODE_DELETED = "node_deleted"  # the provider deleted the node; the claim record still exists
FaultHook = Callable[[str, str], None]  # (fault point, claim id)


def _no_fault(point: str, claim_id: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the reconciler saw in one round, after repairing what it could."""

    nodes: tuple[Node, ...]  # live (not TERMINATED), owned nodes of reachable pools, by id
    replicas: tuple[ReplicaHandle, ...]  # every replica the reachable providers list, by id
    claims: Mapping[str, ClaimRecord]  # claim id -> record, after this round's repairs
    unreachable_pools: tuple[str, ...] = ()  # pools whose nodes or replicas could not be listed this round
    events: tuple[Event, ...] = ()
    insufficient: tuple[InsufficientCapacity, ...] = ()  # re-driven claims that hit a stockout

    def claim_of_node(self, node_id: str) -> ClaimRecord | None:
        for record in self.claims.values():
            if record.node_id == node_id:
                return record
        return None


@dataclass(frozen=True, slots=True)
class CreateResult:
    """What `create_node` did: the node bought (None if none), events, and the refusal if any."""

    node: Node | None
    events: tuple[Event, ...]
    insufficient: InsufficientCapacity | None = None
    error: ProviderError | None = None


@dataclass
class _Round:
    """Scratch state of one reconcile round (never outlives the call)."""

    events: list[Event] = field(default_factory=list)
    insufficient: list[InsufficientCapacity] = field(default_factory=list)


def _nodes_by_claim(listed: Mapping[str, list[Node]]) -> dict[str, list[Node]]:
    """The listed nodes that are not TERMINATED, grouped by the claim id they are tagged with."""
    by_claim: dict[str, list[Node]] = {}
    for nodes in listed.values():
        for node in nodes:
            if node.state is not NodeState.TERMINATED:
                by_claim.setdefault(node.claim_id, []).append(node)
    return by_claim


class Reconciler:
    """Crash-safe node actuation over `providers` (one per pool, keyed by pool name).

    All methods may raise `StateStoreUnavailable` (the claims cannot be read or written: the tick
    is abandoned and nothing was bought without a claim) and `ClaimConflict`.
    """

    def __init__(self, providers: Mapping[str, Provider], claims: ClaimStore, clock: Clock, *,
                 fault_hook: FaultHook | None = None) -> None:
        self._providers = providers
        self._claims = claims
        self._clock = clock
        self._fault = fault_hook or _no_fault

    def set_providers(self, providers: Mapping[str, Provider]) -> None:
        """Swap the providers (after a registry reload added or removed pools)."""
        self._providers = providers

    # -- the level-triggered repair --------------------------------------------------------------

    async def reconcile(self) -> Fleet:
        """List nodes and claims, repair every mismatch (table in the module docstring), and return
        what is now there. Provider errors on one claim or node are logged as events and left for
        the next round; they do not stop the round."""
        scratch = _Round()
        listed, unreachable = await self._list_nodes(scratch)
        read = await self._claims.read()  # after the node lists; claims and ledger in one read
        claims = {record.claim_id: record for record in read.claims}
        nodes_by_claim = _nodes_by_claim(listed)
        live: list[Node] = []
        for claim_id, nodes in sorted(nodes_by_claim.items()):
            if claim_id in read.unreadable:
                continue  # claimed, by a record this release cannot read (a newer one?): hands off
            kept = await self._repair_listed(claim_id, nodes, claims, read.ledger_kept, scratch)
            if kept is not None:
                live.append(kept)
        for claim_id, record in sorted(claims.items()):
            if claim_id in nodes_by_claim or record.claim.pool not in listed:
                continue  # has a node, or its pool is unreachable/unknown: leave it for a later round
            created = await self._repair_unlisted(record, claims, scratch)
            if created is not None:
                live.append(created)
        if not read.ledger_kept and not unreachable:
            await self._claims.keep_ledger(self._clock.wall())
        replicas = await self._list_replicas(sorted(listed), unreachable, scratch)
        return Fleet(nodes=tuple(sorted(live, key=lambda n: n.id)),
                     replicas=tuple(sorted(replicas, key=lambda r: r.id)),
                     claims=dict(claims), unreachable_pools=tuple(sorted(unreachable)),
                     events=tuple(scratch.events), insufficient=tuple(scratch.insufficient))

    async def _list_nodes(self, scratch: _Round) -> tuple[dict[str, list[Node]], list[str]]:
        """Every pool's nodes, by pool, and the pools that could not be listed."""
        listed: dict[str, list[Node]] = {}
        unreachable: list[str] = []
        for pool, provider in sorted(self._providers.items()):
            try:
                listed[pool] = await provider.list()
            except ProviderError as exc:
                unreachable.append(pool)
                scratch.events.append(self._event(None, EventKind.PROVIDER_ERROR, f"pool {pool}: list failed: {exc}"))
        return listed, unreachable

    async def _repair_listed(self, claim_id: str, nodes: list[Node], claims: dict[str, ClaimRecord],
                             ledger_kept: bool, scratch: _Round) -> Node | None:
        """The rows of the table with a node listed, for the nodes of one claim id; updates `claims` and
        returns the node kept live, if any."""
        record = claims.get(claim_id)
        keep = next((n for n in nodes if n.state is not NodeState.TERMINATING), None)
        if record is None and not ledger_kept and keep is not None:  # a node going away is not kept
            record = claims[claim_id] = await self._adopt_unclaimed(keep, scratch)
            nodes = [keep, *(n for n in nodes if n is not keep)]
        for extra in nodes[1:] if record is not None else ():
            # Never expected (create is idempotent), but if a provider broke that promise the
            # extra node is untracked: release it rather than pay for it.
            await self._release_orphan(extra, scratch, why="a second node for one claim")
        node = nodes[0]
        if record is None:
            for orphan in nodes:
                if orphan.state is not NodeState.TERMINATING:  # already going: asking again is noise
                    await self._release_orphan(orphan, scratch, why="no claim")
            return None
        if record.phase is ClaimPhase.PENDING:
            claims[claim_id] = await self._claims.confirm(record, node.id, self._clock.wall())
            scratch.events.append(self._event(node.model, EventKind.NODE_ADOPTED,
                                              f"adopted node {node.id} of pending claim {claim_id}"))
            return node
        if record.phase is ClaimPhase.DELETING:
            if await self._finish_delete(record, node.id, scratch):
                claims.pop(claim_id)
            return None
        return node

    async def _repair_unlisted(self, record: ClaimRecord, claims: dict[str, ClaimRecord],
                               scratch: _Round) -> Node | None:
        """The rows of the table with no node listed, for a claim of a pool listed this round; updates
        `claims` and returns the node a re-driven create bought, if any."""
        if record.phase is ClaimPhase.PENDING:
            created = await self._drive_create(record, scratch)
            if created is None:
                if not await self._still_pending(record):
                    claims.pop(record.claim_id, None)
                return None
            claims[record.claim_id] = created[1]
            return created[0]
        # CONFIRMED without a node: terminated outside kvgate (spot reclaim finished, an
        # operator). DELETING without a node: the delete went through before a crash.
        await self._claims.remove(record)
        claims.pop(record.claim_id)
        if record.phase is ClaimPhase.CONFIRMED:
            scratch.events.append(self._event(record.claim.model, EventKind.PREEMPTED,
                                              f"node {record.node_id} of claim {record.claim_id} is gone"))
        return None

    async def _list_replicas(self, pools: list[str], unreachable: list[str], scratch: _Round) -> list[ReplicaHandle]:
        """The replicas of `pools`; a pool that cannot list them joins `unreachable`."""
        replicas: list[ReplicaHandle] = []
        for pool in pools:
            try:
                replicas.extend(await self._providers[pool].list_replicas())
            except ProviderError as exc:  # its replicas are unknown this round, not gone
                unreachable.append(pool)
                scratch.events.append(self._event(None, EventKind.PROVIDER_ERROR,
                                                  f"pool {pool}: list_replicas failed: {exc}"))
        return replicas

    # -- actions ---------------------------------------------------------------------------------

    async def create_node(self, claim: NodeClaim) -> CreateResult:
        """Buy one node for `claim`: claim first, then the provider, then confirm. Never raises a
        provider error: the result says what happened.

        A claim id that already has a record is not bought again (node None, no error). A stockout
        removes the claim and sets `insufficient` (the caller notes it so the planner picks another
        offering); a final refusal (quota, unknown offering) removes the claim and sets `error`; a
        retryable error sets `error` and leaves the claim PENDING for the next `reconcile` to
        re-drive. Raises `StateStoreUnavailable`: then nothing was bought.
        """
        if claim.pool not in self._providers:
            error = ProviderError(f"claim {claim.id}: no provider for pool {claim.pool!r}")
            return CreateResult(None, (self._event(claim.model, EventKind.PROVIDER_ERROR, str(error)),), error=error)
        try:
            record = await self._claims.write_pending(claim, self._clock.wall())
        except ClaimConflict:
            return CreateResult(None, ())
        self._fault(CLAIM_WRITTEN, claim.id)
        scratch = _Round()
        try:
            created = await self._drive_create(record, scratch, raise_errors=True)
        except InsufficientCapacity as exc:
            return CreateResult(None, tuple(scratch.events), insufficient=exc)
        except ProviderError as exc:
            return CreateResult(None, tuple(scratch.events), error=exc)
        return CreateResult(created[0] if created else None, tuple(scratch.events))

    async def delete_node(self, node_id: str, fleet: Fleet, reason: str) -> list[Event]:
        """Release a node: mark its claim DELETING, delete at the provider, remove the claim.
        Deleting a node with no claim (or one already gone) just asks the provider."""
        scratch = _Round()
        record = fleet.claim_of_node(node_id)
        if record is None:
            node = next((n for n in fleet.nodes if n.id == node_id), None)
            if node is not None:
                await self._providers[node.pool].delete(node_id)
            return scratch.events
        if record.phase is not ClaimPhase.DELETING:
            record = await self._claims.mark_deleting(record, self._clock.wall())
        self._fault(DELETE_MARKED, record.claim_id)
        await self._finish_delete(record, node_id, scratch, reason=reason, raise_errors=True)
        return scratch.events

    # -- protocol steps --------------------------------------------------------------------------

    async def _drive_create(self, record: ClaimRecord, scratch: _Round, *,
                            raise_errors: bool = False) -> tuple[Node, ClaimRecord] | None:
        claim = record.claim
        provider = self._providers[claim.pool]
        try:
            node = await provider.create(claim)
        except InsufficientCapacity as exc:
            await self._claims.remove(record)
            scratch.insufficient.append(exc)
            scratch.events.append(self._event(claim.model, EventKind.INSUFFICIENT_CAPACITY,
                                              f"{claim.offering}: {exc}"))
            if raise_errors:
                raise
            return None
        except ProviderError as exc:
            if not exc.retryable:  # quota, unknown offering: this claim will never be bought
                await self._claims.remove(record)
            scratch.events.append(self._event(claim.model, EventKind.PROVIDER_ERROR,
                                              f"create {claim.id} ({claim.offering}): {exc}"))
            if raise_errors:
                raise
            return None
        self._fault(PROVIDER_CALLED, claim.id)
        confirmed = await self._claims.confirm(record, node.id, self._clock.wall())
        scratch.events.append(self._event(claim.model, EventKind.NODE_CREATE,
                                          f"node {node.id}: {claim.offering} at ${node.price_usd_per_hour:.2f}/h"))
        return node, confirmed

    async def _finish_delete(self, record: ClaimRecord, node_id: str, scratch: _Round, *,
                             reason: str = "re-driven after restart", raise_errors: bool = False) -> bool:
        try:
            await self._providers[record.claim.pool].delete(node_id)
        except ProviderError as exc:
            scratch.events.append(self._event(record.claim.model, EventKind.PROVIDER_ERROR,
                                              f"delete {node_id}: {exc}"))
            if raise_errors:
                raise
            return False  # the claim stays DELETING; the next round re-drives it
        self._fault(NODE_DELETED, record.claim_id)
        await self._claims.remove(record)
        scratch.events.append(self._event(record.claim.model, EventKind.NODE_DELETE, f"node {node_id}: {reason}"))
        return True

    async def _adopt_unclaimed(self, node: Node, scratch: _Round) -> ClaimRecord:
        """Keep a node whose claim the store lost, with a CONFIRMED claim rebuilt from its tags."""
        record = await self._claims.write_confirmed(node, self._clock.wall())
        scratch.events.append(self._event(node.model, EventKind.NODE_ADOPTED,
                                          f"adopted node {node.id} of claim {node.claim_id}: the state store "
                                          "holds no claims (it lost them, or is new), so the node is kept"))
        return record

    async def _release_orphan(self, node: Node, scratch: _Round, *, why: str) -> None:
        try:
            await self._providers[node.pool].delete(node.id)
        except ProviderError as exc:
            scratch.events.append(self._event(node.model, EventKind.PROVIDER_ERROR,
                                              f"release orphan {node.id}: {exc}"))
            return
        scratch.events.append(self._event(node.model, EventKind.ORPHAN_RELEASED,
                                          f"released node {node.id} of claim {node.claim_id}: {why}"))

    async def _still_pending(self, record: ClaimRecord) -> bool:
        # After a failed re-drive the claim is either removed (a final refusal) or left PENDING (a
        # retryable error): the Fleet must show which.
        return any(r.claim_id == record.claim_id for r in await self._claims.list())

    def _event(self, model: str | None, kind: EventKind, message: str) -> Event:
        log.info("%s%s: %s", f"{model}: " if model else "", kind.value, message)
        return Event(self._clock.wall(), model, kind, message)
