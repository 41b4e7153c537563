"""The membership records the autoscaler puts out for gateways: TTL'd heartbeats, one per replica it runs.

`MemberPublisher` remembers what this leader's term last put out, so a replica that leaves the providers'
listing is retired rather than left to vanish. Retiring means one last record, DRAINING, that then lapses:
gateways stop sending to it at their next poll and drop it when the record goes. Removing a READY record
instead would leave the replica in rotation until its health checks fail, since gateways keep a READY member
whose record merely vanished (`router.membership`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from kvgate.autoscaler.fleet import member_record
from kvgate.autoscaler.reconciler import Fleet
from kvgate.state import MemberRecord, StateStore
from kvgate.state import ReplicaState as MemberState


class MemberPublisher:
    """What one leader's term publishes; a new term starts with a new publisher."""

    def __init__(self, store: StateStore, ttl_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._published: dict[str, MemberRecord] = {}  # replica id -> the record this term last put out
        self._retired_this_tick: set[str] = set()  # replicas retired (published DRAINING) in the tick running now

    def new_tick(self) -> None:
        self._retired_this_tick = set()

    async def put(self, record: MemberRecord) -> None:
        """Put out (or renew) one replica's record."""
        await self._store.put_member(record, self._ttl_s)
        self._published[record.replica_id] = record

    async def publish(self, fleet: Fleet, pool_of: Mapping[str, str], *, just_started: Collection[str],
                      stopped: Collection[str], draining: Collection[str]) -> None:
        """Renew the record of every replica listed this tick; retire those no longer listed."""
        present = set(just_started)  # started this tick: not in this tick's listing, their record is out
        for replica in fleet.replicas:
            if replica.id in stopped or replica.id in self._retired_this_tick:
                continue
            record = member_record(replica, pool_of.get(replica.node_id), draining=replica.id in draining)
            if record is None:
                continue
            present.add(replica.id)
            await self.put(record)
        for gone in sorted(self._published.keys() - present):
            last = self._published[gone]
            if last.pool in fleet.unreachable_pools:
                continue  # not listed this tick, not known gone: the record stays until it is, or lapses
            await self.retire(replace(last, state=MemberState.DRAINING))  # the provider no longer lists it

    async def retire(self, record: MemberRecord) -> None:
        """Take a replica out of routing for good: `record` (DRAINING) is put out once more and left to lapse."""
        await self._store.put_member(record, self._ttl_s)
        self._published.pop(record.replica_id, None)  # not renewed: it lapses
        self._retired_this_tick.add(record.replica_id)  # nor put out again by this tick's (older) listing

    async def unpublish(self, replica_id: str) -> None:
        """Remove the record now: for a replica whose drain has ended (gateways saw it DRAINING)."""
        await self._store.remove_member(replica_id)
        self._published.pop(replica_id, None)

    async def drop_stale(self, fleet: Fleet, our_pools: Collection[str]) -> None:
        """Retire records a previous leader left out for replicas that are gone since (rather than at their
        TTL): only records of `our_pools`, and only of pools listed this tick."""
        live = {r.id for r in fleet.replicas}
        for member in await self._store.list_members():
            if (member.pool in our_pools and member.pool not in fleet.unreachable_pools
                    and member.replica_id not in live):
                if member.state is MemberState.DRAINING:
                    await self.unpublish(member.replica_id)
                else:
                    await self.retire(replace(member, state=MemberState.DRAINING))
