"""The live autoscaler: observe -> decide -> actuate, once per tick, by one active copy.

`Autoscaler` is the library entry that `kvgate autoscaler` runs and `kvgate up` embeds:

    autoscaler = Autoscaler(watcher, store, clock, provider_factory=provider_factory_for("demo", clock))
    await autoscaler.start()        # runs ticks every settings.interval_s in a task
    ...
    await autoscaler.stop()         # releases the lease; leaves nodes and replicas running

One tick:
1. **Lease.** `acquire_lease("autoscaler", holder, ttl)` takes or renews the lease; a standby that
   does not get it does nothing else (it retries next tick and takes over once the holder's lease
   expires: ttl after its last renewal).
2. **Reconcile** (`autoscaler.reconciler`): list nodes, repair claims (adopt, release orphans,
   re-drive pending), list replicas. Failed replicas are reported, stopped and their model's starts
   backed off exponentially; replicas past their drain notice are stopped.
3. **Observe**: gateway observations from the state store (`autoscaler.observe`).
4. **Decide**: `decide_replicas` per autoscaled model, then `plan_nodes` over the whole fleet. If a
   pool could not be listed this tick, nothing is planned: deciding on a partial view would buy
   twice what is already running there.
5. **Actuate**: create/delete nodes through the reconciler (claims first), start replicas, drain
   replicas (DRAINING in the membership record, then `stop_replica` after `drain_notice_s`).
6. **Publish**: membership records (TTL'd heartbeats) for routers, and the status record for the
   dashboard. A replica taken out for good without a drain (it failed, its node was preempted or is
   being deleted, the provider no longer lists it) gets one last record, DRAINING, that then lapses:
   gateways keep a READY member whose record merely vanished, as long as its health checks pass.

Stopping (SIGTERM) releases the lease and leaves every node and replica running: the next
autoscaler adopts them through their claims. Nothing is deleted on the way out, because a restart
(an upgrade, a reschedule) must not cost a fleet's cold starts.

Errors: a tick that hits `StateStoreError`, `ProviderError` or a claim conflict logs it, records an
event when it can, and the next tick starts afresh; ticks are spaced `interval_s` apart whatever
happens, so nothing spins.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.autoscaler.claims import ClaimConflict, ClaimStore
from kvgate.autoscaler.fleet import (Backoff, autoscaled_models, cold_start_s, member_record, model_observation,
                                    node_statuses, pending_claims_by_model, pools_of, retired_record)
from kvgate.autoscaler.members import MemberPublisher
from kvgate.autoscaler.observe import GatewayTotals, read_gateway_totals
from kvgate.autoscaler.planner import (
    CreateNode,
    DeleteNode,
    NodeAction,
    PlannerInputs,
    PlannerState,
    StartReplica,
    StopReplica,
    Unschedulable,
    note_insufficient_capacity,
    plan_nodes,
)
from kvgate.autoscaler.reconciler import FaultHook, Fleet, Reconciler
from kvgate.autoscaler.settings import (  # re-exported: the loop's public surface
    AutoscalerSettings,
    FixedSnapshot,
    ProviderFactory,
    SnapshotSource,
    default_holder,
    provider_factory_for,
)
from kvgate.autoscaler.scaler import ModelObservation, ReplicaDecision, ScalerSpec, ScalerState, decide_replicas
from kvgate.autoscaler.status import (
    STATUS_COLLECTION,
    STATUS_ID,
    Event,
    EventKind,
    ModelStatus,
    accrue_cost,
    append_events,
    build_status,
    cost_per_hour,
)
from kvgate.clock import Clock
from kvgate.state import StateStore, StateStoreError
from kvgate.state.outage import Outage
from kvgate.state.records import MALFORMED, read_status
from kvgate.state.schema import SkippedRecords
from kvgate.providers.base import NodeState, Offering, Provider, ProviderError, ReplicaHandle, ReplicaState, replica_spec_for
from kvgate.registry.snapshot import Snapshot

__all__ = ["LEASE_NAME", "Autoscaler", "AutoscalerSettings", "FixedSnapshot", "ProviderFactory", "SnapshotSource",
           "TickReport", "default_holder", "provider_factory_for"]

log = logging.getLogger("kvgate.autoscaler")

LEASE_NAME = "autoscaler"


@dataclass(frozen=True, slots=True)
class TickReport:
    """What one tick did (for tests and logs)."""

    leader: bool
    actions: tuple[NodeAction, ...] = ()
    decisions: Mapping[str, ReplicaDecision] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    error: str | None = None


@dataclass(slots=True)
class _Draining:
    replica: ReplicaHandle
    pool: str
    stop_at: float  # monotonic seconds: routers have seen DRAINING by then
    # stop_replica waits up to drain_timeout_s for in-flight requests, so it runs beside the loop
    # (a 30 s drain must not freeze scaling for every other model); None until started.
    task: asyncio.Task[None] | None = None


@dataclass(frozen=True, slots=True)
class _Tick:
    """What one tick took stock of before deciding; the later steps of the tick read it."""

    snapshot: Snapshot
    fleet: Fleet
    pool_of: Mapping[str, str]  # node id -> pool, of the nodes listed this tick
    stopped: set[str]  # replicas whose drain ended this tick: they may still be in this tick's listing
    now: float  # monotonic seconds
    wall: float  # wall-clock seconds (claims and the planner's stockout memory use it)
    events: list[Event]  # this tick's events so far; the steps append to it


class Autoscaler:
    """One autoscaler process's control loop. See the module docstring.

    `providers` are ready providers by pool name; `provider_factory` builds one for any pool of the
    snapshot that has none (also after a reload adds a pool). Providers of pools removed by a reload
    are kept, so their nodes stay tracked. The caller owns the store and the providers and closes
    them after `stop()`.
    """

    def __init__(self, snapshots: SnapshotSource, store: StateStore, clock: Clock, *,
                 providers: Mapping[str, Provider] | None = None, provider_factory: ProviderFactory | None = None,
                 settings: AutoscalerSettings | None = None, holder: str | None = None,
                 fault_hook: FaultHook | None = None) -> None:
        self.settings = settings or AutoscalerSettings()
        self.holder = holder or default_holder()
        self._snapshots = snapshots
        self._store = store
        self._clock = clock
        self._providers: dict[str, Provider] = dict(providers or {})
        self._factory = provider_factory
        self._failed_pools: dict[str, str] = {}  # pool -> why its provider could not be built
        self._reconciler = Reconciler(self._providers, ClaimStore(store, self.holder), clock, fault_hook=fault_hook)
        self.id_prefix = f"kvg-{uuid.uuid4().hex[:6]}"  # claim/replica ids unique per incarnation
        self._task: asyncio.Task[None] | None = None
        self._store_outage = Outage()  # ticks in a row that could not reach the store
        self.is_leader = False
        self._reset_leadership()

    def _reset_leadership(self) -> None:
        # Everything a leader learns; a new term starts from the store and the providers again.
        for entry in getattr(self, "_draining", {}).values():
            if entry.task is not None:
                entry.task.cancel()
        self._scaler: dict[str, ScalerState] = {}
        self._planner = PlannerState()
        self._backoff: dict[str, Backoff] = {}
        self._failed_seen: set[str] = set()  # failed replicas already reported (and backed off)
        self._preempted_seen: set[str] = set()  # interrupted nodes already reported
        self._draining: dict[str, _Draining] = {}
        self._members = MemberPublisher(self._store, self.settings.member_ttl_s)
        self._offerings: dict[str, tuple[float, list[Offering]]] = {}
        self._events: tuple[Event, ...] = ()
        self._unschedulable: dict[str, str] = {}
        self._cost_total = 0.0
        self._cost_rate = 0.0
        self._last_tick: float | None = None
        self._fresh_term = True
        self._skipped = SkippedRecords(log)  # records written by a newer release: said once each

    @property
    def providers(self) -> Mapping[str, Provider]:
        """The providers in use, by pool (given ones and those the factory built)."""
        return dict(self._providers)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Run the loop in a background task. Idempotent."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"kvgate-autoscaler-{self.holder}")

    async def stop(self) -> None:
        """Stop ticking and release the lease (a standby takes over at once). Nodes and replicas keep
        running for the next autoscaler to adopt. Idempotent; store errors on release are logged."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        stopping = [e.task for e in self._draining.values() if e.task is not None and not e.task.done()]
        if stopping:  # replicas already told to stop: give them a moment, the rest finish on their own
            _, pending = await asyncio.wait(stopping, timeout=self.settings.stop_wait_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*stopping, return_exceptions=True)
        if self.is_leader:
            try:
                await self._store.release_lease(LEASE_NAME, self.holder)
            except StateStoreError as exc:
                log.warning("could not release the autoscaler lease (it expires by itself): %s", exc)
        self.is_leader = False

    async def release_fleet(self) -> list[Event]:
        """Stop every replica and delete every node of this cluster (claims removed), for a caller
        that owns the whole fleet and is going away for good: `kvgate up` on Ctrl-C. Call after
        `stop()`. Replicas are drained in parallel (each up to `drain_timeout_s`) before their nodes
        go. Provider errors are returned as events, not raised; raises `StateStoreUnavailable`."""
        fleet = await self._reconciler.reconcile()
        events = list(fleet.events)
        pool_of = {node.id: node.pool for node in fleet.nodes}

        async def stop(replica: ReplicaHandle) -> None:
            # DRAINING while it finishes what it holds: gateways send it nothing new (the record may lapse
            # before a long stop ends; gateways drop a DRAINING member whose record goes).
            await self._members.retire(retired_record(replica, pool_of[replica.node_id]))
            try:
                await self._providers[pool_of[replica.node_id]].stop_replica(replica.id, self.settings.drain_timeout_s)
            except ProviderError as exc:
                events.append(self._event(replica.model, EventKind.PROVIDER_ERROR, f"stop {replica.id}: {exc}"))
            await self._members.unpublish(replica.id)

        await asyncio.gather(*(stop(r) for r in fleet.replicas if r.node_id in pool_of))
        for node in fleet.nodes:
            try:
                events.extend(await self._reconciler.delete_node(node.id, fleet, "released on shutdown"))
            except ProviderError as exc:
                events.append(self._event(node.model, EventKind.PROVIDER_ERROR, f"delete {node.id}: {exc}"))
        return events

    async def run(self) -> None:
        """Tick every `interval_s` until cancelled."""
        while True:
            await self.tick()
            await self._clock.sleep(self.settings.interval_s)

    # -- one tick --------------------------------------------------------------------------------

    async def tick(self) -> TickReport:
        """One observe -> decide -> actuate round. Never raises for store or provider trouble."""
        try:
            held = await self._store.acquire_lease(LEASE_NAME, self.holder, self.settings.lease_ttl_s)
        except StateStoreError as exc:  # a line a minute at most, no traceback: Redis may start after this process
            note = self._store_outage.failed(self._clock.now())
            if note is not None:
                log.warning("%s; acting as standby this tick, next try in %g s%s", exc, self.settings.interval_s, note)
            return TickReport(leader=False, error=str(exc))
        recovered = self._store_outage.recovered(self._clock.now())
        if recovered is not None:
            log.info("the state store answers again %s", recovered)
        if not held:
            if self.is_leader:
                log.warning("lost the autoscaler lease to %s", await self._holder_or_unknown())
                self.is_leader = False
                self._reset_leadership()
            return TickReport(leader=False)
        events: list[Event] = []
        if not self.is_leader:
            self.is_leader = True
            self._reset_leadership()
            events.append(self._event(None, EventKind.LEASE_ACQUIRED, f"{self.holder} is the active autoscaler"))
        try:
            return await self._lead(events)
        except (StateStoreError, ProviderError, ClaimConflict) as exc:
            log.warning("autoscaler tick abandoned: %s", exc)
            return TickReport(leader=True, events=tuple(events), error=str(exc))
        except Exception as exc:  # a bug must not end the control loop; the next tick starts afresh
            log.exception("autoscaler tick failed")
            return TickReport(leader=True, events=tuple(events), error=f"{type(exc).__name__}: {exc}")

    async def _lead(self, events: list[Event]) -> TickReport:
        self._members.new_tick()
        tick = await self._take_stock(events)
        read = await read_gateway_totals(self._store, tick.wall, self.settings.observation_max_age_s, self._skipped)
        decisions, observations = self._decide_models(tick, read.totals)
        actions: list[NodeAction] = []
        just_started: set[str] = set()
        if tick.fleet.unreachable_pools:
            log.warning("not planning: pools %s could not be listed", ", ".join(tick.fleet.unreachable_pools))
        else:
            actions = await self._plan(tick, decisions)
            just_started = await self._act(tick, actions)
        await self._members.publish(tick.fleet, tick.pool_of, just_started=just_started, stopped=tick.stopped,
                                    draining=self._draining)
        self._events = append_events(self._events, events)
        await self._write_status(tick.fleet, decisions, observations, tick.now, tick.wall)
        return TickReport(leader=True, actions=tuple(actions), decisions=decisions, events=tuple(events))

    async def _take_stock(self, events: list[Event]) -> _Tick:
        """Reconcile: what runs now, after repairing claims, retiring failed replicas and ending drains."""
        now, wall = self._clock.now(), self._clock.wall()
        snapshot = self._snapshots.current
        self._ensure_providers(snapshot, events)
        if self._fresh_term:
            await self._resume_status()
        fleet = await self._reconciler.reconcile()
        events.extend(fleet.events)
        for exc in fleet.insufficient:
            self._planner = note_insufficient_capacity(self._planner, exc.offering, wall,
                                                       self.settings.planner.ice_ttl_s)
        pool_of = pools_of(fleet.nodes)
        await self._handle_failed(fleet, pool_of, now, events)
        stopped = await self._finish_drains(now, events)  # may still be in this tick's listing: skip them
        if self._fresh_term:
            await self._members.drop_stale(fleet, self._providers)
            self._fresh_term = False
        return _Tick(snapshot, fleet, pool_of, stopped, now, wall, events)

    def _decide_models(self, tick: _Tick, totals: Mapping[str, GatewayTotals],
                         ) -> tuple[dict[str, ReplicaDecision], dict[str, ModelObservation]]:
        """`decide_replicas` for every autoscaled model; an event for each count that changed."""
        pending_by_model = pending_claims_by_model(tick.fleet.nodes, tick.fleet.claims.values())
        draining = frozenset(self._draining)
        decisions: dict[str, ReplicaDecision] = {}
        observations: dict[str, ModelObservation] = {}
        for name in autoscaled_models(tick.snapshot):
            doc = tick.snapshot.models[name]
            obs = model_observation(name, totals.get(name), tick.fleet.replicas, draining,
                                    pending_by_model.get(name, 0))
            spec = ScalerSpec.of(doc, cold_start_s(tick.snapshot, doc))
            previous = self._scaler.get(name)
            self._scaler[name], decision = decide_replicas(spec, previous or ScalerState(), obs, tick.now)
            decisions[name], observations[name] = decision, obs
            before = (previous.desired if previous is not None and previous.desired is not None
                      else obs.ready_replicas + obs.starting_replicas)
            if decision.desired != before:
                kind = EventKind.SCALE_UP if decision.desired > before else EventKind.SCALE_DOWN
                tick.events.append(self._event(name, kind, f"{before} -> {decision.desired}: {decision.reason}"))
        return decisions, observations

    async def _plan(self, tick: _Tick, decisions: Mapping[str, ReplicaDecision]) -> list[NodeAction]:
        """`plan_nodes` over the whole fleet; draining and just-stopped replicas are left out of its view."""
        fleet = tick.fleet
        inputs = PlannerInputs(
            snapshot=tick.snapshot, desired={name: d.desired for name, d in decisions.items()},
            nodes=fleet.nodes,
            replicas=tuple(r for r in fleet.replicas
                           if r.id not in self._draining and r.id not in tick.stopped
                           and r.state in (ReplicaState.STARTING, ReplicaState.READY)),
            offerings=tuple(await self._all_offerings(tick.now, tick.events)),
            claims=tuple(r.claim for r in fleet.claims.values() if r.node_id not in tick.pool_of),
            settings=self.settings.planner, id_prefix=self.id_prefix)
        self._planner, actions = plan_nodes(inputs, self._planner, tick.wall)
        unschedulable = {a.model for a in actions if isinstance(a, Unschedulable)}
        self._unschedulable = {m: r for m, r in self._unschedulable.items() if m in unschedulable}
        return actions

    async def _act(self, tick: _Tick, actions: list[NodeAction]) -> set[str]:
        """Perform the planner's actions in order; returns the ids of the replicas started."""
        just_started: set[str] = set()
        renewed_at = tick.now
        for action in actions:
            if self._clock.now() - renewed_at >= self.settings.lease_ttl_s / 3:
                # Slow provider calls: renew before acting further, and stop acting if another
                # autoscaler took over meanwhile (two leaders must never buy at once).
                if not await self._store.acquire_lease(LEASE_NAME, self.holder, self.settings.lease_ttl_s):
                    log.warning("lease lost during a tick; %d action(s) left to the new leader",
                                len(actions) - actions.index(action))
                    break
                renewed_at = self._clock.now()
            started = await self._perform(action, tick.snapshot, tick.fleet, tick.now, tick.wall, tick.events,
                                          tick.stopped)
            if started is not None:
                just_started.add(started)
        return just_started

    # -- actions ---------------------------------------------------------------------------------

    async def _perform(self, action: NodeAction, snapshot: Snapshot, fleet: Fleet, now: float, wall: float,
                       events: list[Event], stopped: set[str]) -> str | None:
        """Perform one planner action; returns the id of a replica it started, if any."""
        if isinstance(action, CreateNode):
            model = action.claim.model or ""
            backoff = self._backoff.get(model, Backoff())
            if action.boots_replica and not backoff.may_start(now):
                return None  # buying it starts a replica, and this model's starts are backed off
            result = await self._reconciler.create_node(action.claim)
            events.extend(result.events)
            if result.insufficient is not None:
                self._planner = note_insufficient_capacity(self._planner, result.insufficient.offering, wall,
                                                           self.settings.planner.ice_ttl_s)
            elif action.boots_replica and result.error is not None and not result.error.retryable:
                # Refused for good (a launch EC2 will never accept): back off as for a failed start, or the
                # planner asks for the same node again every tick.
                self._backoff[model] = backoff.after_failure(now, self.settings.backoff_base_s,
                                                             self.settings.backoff_max_s)
        elif isinstance(action, DeleteNode):
            node = next((n for n in fleet.nodes if n.id == action.node_id), None)
            if node is not None and node.state is not NodeState.INTERRUPTED and any(
                    entry.replica.node_id == node.id for entry in self._draining.values()):
                # The planner does not see draining replicas, so the node looks empty; deleting it
                # would cut their in-flight requests. It asks again next tick, after the drain.
                return None
            for replica in fleet.replicas:
                if replica.node_id != action.node_id:
                    continue
                if replica.state in (ReplicaState.STARTING, ReplicaState.READY) and replica.id not in stopped:
                    # FAILED ones were retired by _handle_failed; stopped ones were drained first.
                    await self._members.retire(retired_record(replica, node.pool if node is not None else None))
                self._forget_drain(replica.id)
            try:
                events.extend(await self._reconciler.delete_node(action.node_id, fleet, action.reason))
            except ProviderError as exc:  # the claim stays DELETING; reconcile re-drives it
                events.append(self._event(None, EventKind.PROVIDER_ERROR, f"delete {action.node_id}: {exc}"))
        elif isinstance(action, StartReplica):
            return await self._start_replica(action, snapshot, fleet, now, events)
        elif isinstance(action, StopReplica):
            replica = next((r for r in fleet.replicas if r.id == action.replica_id), None)
            pool = next((n.pool for n in fleet.nodes if n.id == action.node_id), None)
            if replica is not None and pool is not None and replica.id not in self._draining:
                self._draining[replica.id] = _Draining(replica, pool, now + self.settings.drain_notice_s)
                events.append(self._event(action.model, EventKind.REPLICA_DRAIN,
                                          f"draining {replica.id}: {action.reason}"))
        elif isinstance(action, Unschedulable):
            if self._unschedulable.get(action.model) != action.reason:
                self._unschedulable[action.model] = action.reason
                events.append(self._event(action.model, EventKind.INSUFFICIENT_CAPACITY,
                                          f"{action.replicas} replica(s) fit nowhere: {action.reason}"))
        return None

    async def _start_replica(self, action: StartReplica, snapshot: Snapshot, fleet: Fleet, now: float,
                             events: list[Event]) -> str | None:
        backoff = self._backoff.get(action.model, Backoff())
        if not backoff.may_start(now) or action.model not in snapshot.models:
            return None  # backing off after failures (the status record's reason says so)
        node = next((n for n in fleet.nodes if n.id == action.node_id), None)
        if node is None:
            return None
        spec = replica_spec_for(snapshot.models[action.model], snapshot.adapters_of(action.model))
        try:
            handle = await self._providers[node.pool].start_replica(node.id, spec, action.replica_id)
        except ProviderError as exc:
            if not exc.retryable:
                self._backoff[action.model] = backoff.after_failure(now, self.settings.backoff_base_s,
                                                                    self.settings.backoff_max_s)
            events.append(self._event(action.model, EventKind.REPLICA_FAILED,
                                      f"start {action.replica_id} on {node.id}: {exc}"))
            return None
        events.append(self._event(action.model, EventKind.REPLICA_START,
                                  f"{handle.id} on {node.id} ({node.instance_type}): {action.reason}"))
        record = member_record(handle, node.pool, draining=False)
        if record is not None:
            await self._members.put(record)
        return handle.id

    async def _handle_failed(self, fleet: Fleet, pool_of: Mapping[str, str], now: float,
                             events: list[Event]) -> None:
        self._failed_seen &= {r.id for r in fleet.replicas}
        interrupted = {n.id for n in fleet.nodes if n.state is NodeState.INTERRUPTED}
        self._preempted_seen &= interrupted
        for node in fleet.nodes:
            if node.id in interrupted and node.id not in self._preempted_seen:
                self._preempted_seen.add(node.id)
                events.append(self._event(node.model, EventKind.PREEMPTED,
                                          f"node {node.id} ({node.instance_type}, {node.capacity_type.value}): "
                                          f"{node.reason or 'interrupted'}"))
        for replica in fleet.replicas:
            if replica.state is ReplicaState.READY:
                self._backoff.pop(replica.model, None)
            if replica.state is not ReplicaState.FAILED or replica.id in self._failed_seen:
                continue
            self._failed_seen.add(replica.id)  # pruned below once the provider stops listing it
            await self._members.retire(retired_record(replica, pool_of.get(replica.node_id)))
            self._forget_drain(replica.id)
            if replica.node_id in interrupted:
                continue  # the node was preempted: not the replica's fault, no back-off
            backoff = self._backoff.get(replica.model, Backoff()).after_failure(
                now, self.settings.backoff_base_s, self.settings.backoff_max_s)
            self._backoff[replica.model] = backoff
            events.append(self._event(replica.model, EventKind.REPLICA_FAILED,
                                      f"{replica.id} failed: {replica.reason or 'no reason given'}; "
                                      f"next start in {backoff.retry_at - now:.0f}s"))
            pool = pool_of.get(replica.node_id)
            if pool is not None:
                try:
                    await self._providers[pool].stop_replica(replica.id, 0.0)
                except ProviderError as exc:
                    events.append(self._event(replica.model, EventKind.PROVIDER_ERROR,
                                              f"clean up failed replica {replica.id}: {exc}"))

    async def _finish_drains(self, now: float, events: list[Event]) -> set[str]:
        """Start `stop_replica` for replicas whose drain notice is over, and collect finished stops;
        returns the ids stopped since the last tick. A failed stop is retried next tick."""
        stopped = set()
        for replica_id, entry in sorted(self._draining.items()):
            if entry.task is None:
                if now >= entry.stop_at:
                    entry.task = asyncio.create_task(
                        self._providers[entry.pool].stop_replica(replica_id, self.settings.drain_timeout_s),
                        name=f"kvgate-stop-{replica_id}")
                continue
            if not entry.task.done():
                continue
            error = entry.task.exception() if not entry.task.cancelled() else None
            if entry.task.cancelled() or error is not None:
                entry.task = None
                events.append(self._event(entry.replica.model, EventKind.PROVIDER_ERROR,
                                          f"stop {replica_id}: {error or 'cancelled'}; retrying"))
                continue
            del self._draining[replica_id]
            stopped.add(replica_id)
            await self._members.unpublish(replica_id)
            events.append(self._event(entry.replica.model, EventKind.REPLICA_STOP, f"stopped {replica_id}"))
        return stopped

    def _forget_drain(self, replica_id: str) -> None:
        entry = self._draining.pop(replica_id, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()

    # -- publishing ------------------------------------------------------------------------------

    async def _resume_status(self) -> None:
        # The dashboard's running cost and event log continue across leaders.
        try:
            previous = await read_status(self._store, self._skipped)
        except MALFORMED:
            self._cost_total, self._events = 0.0, ()
            return
        if previous is not None:
            self._cost_total, self._events = previous.cost_usd_total, previous.events

    async def _write_status(self, fleet: Fleet, decisions: Mapping[str, ReplicaDecision],
                            observations: Mapping, now: float, wall: float) -> None:
        if self._last_tick is not None:
            self._cost_total = accrue_cost(self._cost_total, self._cost_rate, now - self._last_tick)
        self._last_tick = now
        nodes = node_statuses(fleet.nodes, fleet.replicas)
        self._cost_rate = cost_per_hour(nodes)
        models = {}
        for name, decision in decisions.items():
            obs = observations[name]
            reason = decision.reason
            backoff = self._backoff.get(name)
            if backoff is not None and not backoff.may_start(now):
                reason += f"; starts backed off {backoff.retry_at - now:.0f}s after {backoff.failures} failure(s)"
            models[name] = ModelStatus(desired=decision.desired, ready=obs.ready_replicas,
                                       starting=obs.starting_replicas, panic=decision.panic,
                                       forecast_rps=decision.forecast_rps, arrivals_per_s=obs.arrivals_per_s,
                                       queued=obs.queued_at_gateways, reason=reason)
        status = build_status(updated_at=wall, holder=self.holder, models=models, events=self._events,
                              nodes=nodes, cost_usd_total=self._cost_total)
        await self._store.put_record(STATUS_COLLECTION, STATUS_ID, status.to_json())

    # -- helpers ---------------------------------------------------------------------------------

    def _ensure_providers(self, snapshot: Snapshot, events: list[Event]) -> None:
        if self._factory is None:
            return
        for name, pool in sorted(snapshot.pools.items()):
            if name in self._providers or self._failed_pools.get(name) == snapshot.version:
                continue
            try:
                self._providers[name] = self._factory(name, pool)
            except ProviderError as exc:
                self._failed_pools[name] = snapshot.version  # retried after the next reload only
                events.append(self._event(None, EventKind.PROVIDER_ERROR, f"pool {name}: {exc}"))
        self._reconciler.set_providers(self._providers)

    async def _all_offerings(self, now: float, events: list[Event]) -> list[Offering]:
        result: list[Offering] = []
        for pool, provider in sorted(self._providers.items()):
            cached = self._offerings.get(pool)
            if cached is None or now - cached[0] >= self.settings.offerings_refresh_s:
                try:
                    cached = (now, await provider.offerings())
                    self._offerings[pool] = cached
                except ProviderError as exc:
                    events.append(self._event(None, EventKind.PROVIDER_ERROR, f"pool {pool}: offerings: {exc}"))
                    if cached is None:
                        continue
            result.extend(cached[1])
        return result

    async def _holder_or_unknown(self) -> str:
        try:
            return await self._store.lease_holder(LEASE_NAME) or "nobody"
        except StateStoreError:
            return "unknown"

    def _event(self, model: str | None, kind: EventKind, message: str) -> Event:
        log.info("%s%s: %s", f"{model}: " if model else "", kind.value, message)
        return Event(self._clock.wall(), model, kind, message)
