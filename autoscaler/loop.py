"""The live autoscaler: observe -> decide -> actuate, once per tick, by one active copy.

`Autoscaler` is the library entry that `kvgate autoscaler` runs and `kvgate up` embeds:

    autoscaler = Autoscaler(watcher, store, clock, provider_factory=provider_factory_for("demo", clock))
    await autoscaler.start()        # runs ticks every settings.interval_s in a task
    ...
    await autoscaler.stop()         # releases the lease; leaves nodes and replicas running

One tick; the loop only gathers and performs, the decision is `autoscaler.decide.decide`, pure, the
same function the simulator replays:
1. **Lease.** `acquire_lease("autoscaler", holder, ttl)` takes or renews the lease; a standby that
   does not get it does nothing else (it retries next tick and takes over once the holder's lease
   expires: ttl after its last renewal).
2. **Gather** `TickInputs`: reconcile (`autoscaler.reconciler`: list nodes, repair claims, list
   replicas), gateway totals from the state store (`autoscaler.observe`), offerings, and the outcomes of
   the last tick's actions (refusals, stops that ended).
3. **Decide**: failures, drains, replica counts per autoscaled model and the node plan (`decide`'s
   docstring). If a pool could not be listed this tick, nothing is planned.
4. **Act**, in the decision's order: retire failed replicas from routing and clean them up, begin the
   stops whose drain notice is over (in tasks beside the loop: a 30 s drain must not freeze scaling),
   create/delete nodes through the reconciler (claims first), start replicas.
5. **Publish**: membership records (TTL'd heartbeats) for routers, DRAINING for replicas draining, and
   the status record for the dashboard. A replica taken out for good without a drain (it failed, its
   node was preempted or is being deleted, the provider no longer lists it) gets one last record,
   DRAINING, that then lapses: gateways keep a READY member whose record merely vanished, as long as
   its health checks pass.

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
from kvgate.autoscaler.decide import (Action, BeginStop, CleanUp, CreateRefused, DecideSpec, LoopState, Outcome,
                                      Retire, StartRefused, StopEnded, Tick, TickInputs, Unpublish, decide)
from kvgate.autoscaler.fleet import member_record, node_statuses, pools_of, retired_record
from kvgate.autoscaler.members import MemberPublisher
from kvgate.autoscaler.metrics import Provisioning, Reading, provisioning
from kvgate.autoscaler.observe import read_gateway_totals
from kvgate.autoscaler.planner import CreateNode, DeleteNode, StartReplica
from kvgate.autoscaler.reconciler import FaultHook, Fleet, Reconciler
from kvgate.autoscaler.settings import (  # re-exported: the loop's public surface
    AutoscalerSettings,
    FixedSnapshot,
    ProviderFactory,
    SnapshotSource,
    default_holder,
    provider_factory_for,
)
from kvgate.autoscaler.scaler import ReplicaDecision
from kvgate.autoscaler.status import (
    STATUS_COLLECTION,
    STATUS_ID,
    AutoscalerStatus,
    Event,
    EventKind,
    ModelStatus,
    accrue_cost,
    append_events,
    build_status,
    cost_per_hour,
)
from kvgate.clock import Clock, sleep_or_wake
from kvgate.state import StateStore, StateStoreError
from kvgate.state.base import raise_if_cancelled
from kvgate.state.outage import Outage
from kvgate.state.records import MALFORMED, read_status
from kvgate.state.schema import SkippedRecords
from kvgate.providers.base import (NodeState, Offering, Provider, ProviderError, ReplicaHandle, WatchesReadiness,
                                  replica_spec_for)
from kvgate.registry.snapshot import Snapshot

__all__ = ["LEASE_NAME", "Autoscaler", "AutoscalerSettings", "FixedSnapshot", "ProviderFactory", "SnapshotSource",
           "TickReport", "default_holder", "provider_factory_for"]

log = logging.getLogger("kvgate.autoscaler")

LEASE_NAME = "autoscaler"


@dataclass(frozen=True, slots=True)
class TickReport:
    """What one tick did (for tests and logs)."""

    leader: bool
    actions: tuple[Action, ...] = ()
    decisions: Mapping[str, ReplicaDecision] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    error: str | None = None


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
        s = self.settings
        self._spec = DecideSpec(drain_notice_s=s.drain_notice_s, backoff_base_s=s.backoff_base_s,
                                backoff_max_s=s.backoff_max_s, planner=s.planner, id_prefix=self.id_prefix)
        self._task: asyncio.Task[None] | None = None
        self._store_outage = Outage()  # ticks in a row that could not reach the store
        self._reached_store_at: float | None = None  # wall seconds of the last tick that reached the store
        self._lease_renewed_at: float | None = None  # monotonic seconds of the last tick that held the lease
        self.is_leader = False
        self._reset_leadership()

    def _reset_leadership(self) -> None:
        # Everything a leader learns; a new term starts from the store and the providers again.
        for task in getattr(self, "_stops", {}).values():
            task.cancel()
        self._state = LoopState()
        self._outcomes: list[Outcome] = []  # refusals seen while acting, for the next decision
        self._stops: dict[str, asyncio.Task[None]] = {}  # replica id -> its stop_replica under way
        self._ready_watches: dict[str, asyncio.Task[None]] = {}  # replica id -> a watch for its readiness
        self._members = MemberPublisher(self._store, self.settings.member_ttl_s)
        self._offerings: dict[str, tuple[float, list[Offering]]] = {}
        self._events: tuple[Event, ...] = ()
        self._cost_total = 0.0
        self._cost_rate = 0.0
        self._last_tick: float | None = None
        self._fresh_term = True
        self._skipped = SkippedRecords(log)  # records written by a newer release: said once each
        self._status: AutoscalerStatus | None = None  # the last status written, and what is still provisioning,
        self._provisioning: tuple[Provisioning, ...] = ()  # for the metrics (`reading`)
        self._woken = asyncio.Event()  # set by wake(): the next tick runs without waiting out interval_s

    @property
    def providers(self) -> Mapping[str, Provider]:
        """The providers in use, by pool (given ones and those the factory built)."""
        return dict(self._providers)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Run the loop in a background task. Idempotent."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"kvgate-autoscaler-{self.holder}")

    @property
    def running(self) -> bool:
        """Whether the loop's task runs (started and not ended)."""
        return self._task is not None and not self._task.done()

    def wake(self) -> None:
        """Tick now rather than at the end of the interval (or right after the tick under way): a request waits
        at a model with no ready replica, or a starting replica became ready. Wakes during one tick make one
        more tick, not one each."""
        self._woken.set()

    async def stop(self) -> None:
        """Stop ticking and release the lease (a standby takes over at once). Nodes and replicas keep
        running for the next autoscaler to adopt. Idempotent; store errors on release are logged."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        watches = list(self._ready_watches.values())
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        self._ready_watches.clear()
        stopping = [task for task in self._stops.values() if not task.done()]
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
        """Tick every `interval_s`, or sooner when woken (`wake`), until cancelled."""
        while True:
            self._woken.clear()  # a wake during the tick below is kept: it makes the next tick come at once
            await self.tick()
            raise_if_cancelled()
            await sleep_or_wake(self._clock, self.settings.interval_s, self._woken)

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
        self._reached_store_at = self._clock.wall()
        recovered = self._store_outage.recovered(self._clock.now())
        if recovered is not None:
            log.info("the state store answers again %s", recovered)
        if held:
            self._lease_renewed_at = self._clock.now()
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
            if isinstance(exc, StateStoreError):  # the store failed mid-tick: down, as far as the metrics go
                self._store_outage.failed(self._clock.now())
            log.warning("autoscaler tick abandoned: %s", exc)
            return TickReport(leader=True, events=tuple(events), error=str(exc))
        except Exception as exc:  # a bug must not end the control loop; the next tick starts afresh
            log.exception("autoscaler tick failed")
            return TickReport(leader=True, events=tuple(events), error=f"{type(exc).__name__}: {exc}")

    async def _lead(self, events: list[Event]) -> TickReport:
        self._members.new_tick()
        inputs = await self._gather(events)
        tick = decide(self._spec, self._state, inputs)
        self._state = tick.state
        self._cancel_forgotten_stops()
        for event in tick.events:
            self._log_event(event)
        events.extend(tick.events)
        if not tick.planned:
            log.warning("not planning: pools %s could not be listed", ", ".join(inputs.fleet.unreachable_pools))
        just_started = await self._act(tick, inputs, events)
        await self._members.publish(inputs.fleet, pools_of(inputs.fleet.nodes), just_started=just_started,
                                    stopped=tick.stopped, draining=self._state.draining)
        self._events = append_events(self._events, events)
        await self._write_status(inputs.fleet, tick, inputs.now, inputs.wall)
        return TickReport(leader=True, actions=tick.actions, decisions=tick.decisions, events=tuple(events))

    async def _gather(self, events: list[Event]) -> TickInputs:
        """Everything the decision looks at: the reconciled fleet (claims repaired), gateway totals, offerings
        (only when every pool was listed: nothing is planned otherwise) and what became of the last actions."""
        now, wall = self._clock.now(), self._clock.wall()
        snapshot = self._snapshots.current
        self._ensure_providers(snapshot, events)
        if self._fresh_term:
            await self._resume_status()
        fleet = await self._reconciler.reconcile()
        events.extend(fleet.events)
        if self._fresh_term:
            await self._members.drop_stale(fleet, self._providers)
            self._fresh_term = False
        read = await read_gateway_totals(self._store, wall, self.settings.observation_max_age_s, self._skipped)
        offerings = () if fleet.unreachable_pools else tuple(await self._all_offerings(now, events))
        return TickInputs(snapshot, fleet, read.totals, offerings, now, wall, self._take_outcomes())

    def _take_outcomes(self) -> tuple[Outcome, ...]:
        """What the last tick's actions came to: refusals seen while acting, and stops that ended since."""
        outcomes, self._outcomes = self._outcomes, []
        for replica_id, task in sorted(self._stops.items()):
            if not task.done():
                continue
            del self._stops[replica_id]
            error = "cancelled" if task.cancelled() else task.exception()
            outcomes.append(StopEnded(replica_id, None if error is None else str(error)))
        return tuple(outcomes)

    def _cancel_forgotten_stops(self) -> None:
        """A stop under way for a replica whose drain the decision dropped (it failed, its node is going)."""
        for replica_id in [r for r in self._stops if r not in self._state.draining]:
            self._stops.pop(replica_id).cancel()

    async def _act(self, tick: Tick, inputs: TickInputs, events: list[Event]) -> set[str]:
        """Perform the decision's actions in order; returns the ids of the replicas started."""
        just_started: set[str] = set()
        renewed_at = inputs.now
        for index, action in enumerate(tick.actions):
            if self._clock.now() - renewed_at >= self.settings.lease_ttl_s / 3:
                # Slow provider calls: renew before acting further, and stop acting if another
                # autoscaler took over meanwhile (two leaders must never buy at once).
                if not await self._store.acquire_lease(LEASE_NAME, self.holder, self.settings.lease_ttl_s):
                    log.warning("lease lost during a tick; %d action(s) left to the new leader",
                                len(tick.actions) - index)
                    break
                renewed_at = self._clock.now()
            started = await self._perform(action, inputs, events)
            if started is not None:
                just_started.add(started)
        return just_started

    # -- actions ---------------------------------------------------------------------------------

    async def _perform(self, action: Action, inputs: TickInputs, events: list[Event]) -> str | None:
        """Perform one action; returns the id of a replica it started, if any. Refusals become outcomes."""
        fleet = inputs.fleet
        if isinstance(action, Retire):
            await self._members.retire(retired_record(action.replica, action.pool))
        elif isinstance(action, Unpublish):
            await self._members.unpublish(action.replica_id)
        elif isinstance(action, BeginStop):
            self._stops[action.replica_id] = asyncio.create_task(
                self._providers[action.pool].stop_replica(action.replica_id, self.settings.drain_timeout_s),
                name=f"kvgate-stop-{action.replica_id}")  # beside the loop: a 30 s drain must not freeze scaling
        elif isinstance(action, CleanUp):
            try:
                await self._providers[action.pool].stop_replica(action.replica_id, 0.0)
            except ProviderError as exc:
                events.append(self._event(action.model, EventKind.PROVIDER_ERROR,
                                          f"clean up failed replica {action.replica_id}: {exc}"))
        elif isinstance(action, CreateNode):
            result = await self._reconciler.create_node(action.claim)
            events.extend(result.events)
            refused = result.insufficient.offering if result.insufficient is not None else None
            if refused is not None or result.error is not None:
                self._outcomes.append(CreateRefused(
                    action.claim.model or "", action.boots_replica, inputs.now, inputs.wall, refused,
                    result.error.retryable if result.error is not None else True))
            elif result.node is not None and result.node.state is NodeState.RUNNING:
                self.wake()  # running at once (a local slot, a Slurm claim): the next tick, now, places replicas
        elif isinstance(action, DeleteNode):
            try:
                events.extend(await self._reconciler.delete_node(action.node_id, fleet, action.reason))
            except ProviderError as exc:  # the claim stays DELETING; reconcile re-drives it
                events.append(self._event(None, EventKind.PROVIDER_ERROR, f"delete {action.node_id}: {exc}"))
        elif isinstance(action, StartReplica):
            return await self._start_replica(action, inputs, events)
        return None

    async def _start_replica(self, action: StartReplica, inputs: TickInputs, events: list[Event]) -> str | None:
        node = next((n for n in inputs.fleet.nodes if n.id == action.node_id), None)
        if node is None:
            return None
        snapshot = inputs.snapshot
        spec = replica_spec_for(snapshot.models[action.model], snapshot.adapters_of(action.model))
        try:
            handle = await self._providers[node.pool].start_replica(node.id, spec, action.replica_id)
        except ProviderError as exc:
            self._outcomes.append(StartRefused(action.model, exc.retryable, inputs.now))
            events.append(self._event(action.model, EventKind.REPLICA_FAILED,
                                      f"start {action.replica_id} on {node.id}: {exc}"))
            return None
        events.append(self._event(action.model, EventKind.REPLICA_START,
                                  f"{handle.id} on {node.id} ({node.instance_type}): {action.reason}"))
        record = member_record(handle, node.pool, draining=False)
        if record is not None:
            await self._members.put(record)
        self._watch_readiness(self._providers[node.pool], handle.id)
        return handle.id

    def _watch_readiness(self, provider: Provider, replica_id: str) -> None:
        """Where the provider can watch a starting replica, wake the loop when it is ready (or failed), so that it
        is published READY, and requests waiting for it go, at once instead of at the next tick."""
        if not isinstance(provider, WatchesReadiness) or replica_id in self._ready_watches:
            return

        async def watch() -> None:
            try:
                await provider.wait_ready(replica_id, self.settings.ready_watch_s)
                self.wake()
            except ProviderError:  # gone before it was ready: the next tick sees to it
                pass
            finally:
                self._ready_watches.pop(replica_id, None)

        self._ready_watches[replica_id] = asyncio.create_task(watch(), name=f"kvgate-ready-{replica_id}")

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

    async def _write_status(self, fleet: Fleet, tick: Tick, now: float, wall: float) -> None:
        if self._last_tick is not None:
            self._cost_total = accrue_cost(self._cost_total, self._cost_rate, now - self._last_tick)
        self._last_tick = now
        nodes = node_statuses(fleet.nodes, fleet.replicas)
        self._cost_rate = cost_per_hour(nodes)
        models = {}
        for name, decision in tick.decisions.items():
            obs = tick.observations[name]
            reason = decision.reason
            backoff = self._state.backoff.get(name)
            if backoff is not None and not backoff.may_start(now):
                reason += f"; starts backed off {backoff.retry_at - now:.0f}s after {backoff.failures} failure(s)"
            models[name] = ModelStatus(desired=decision.desired, ready=obs.ready_replicas,
                                       starting=obs.starting_replicas, panic=decision.panic,
                                       forecast_rps=decision.forecast_rps, arrivals_per_s=obs.arrivals_per_s,
                                       queued=obs.queued_at_gateways, reason=reason)
        status = build_status(updated_at=wall, holder=self.holder, models=models, events=self._events,
                              nodes=nodes, cost_usd_total=self._cost_total)
        await self._store.put_record(STATUS_COLLECTION, STATUS_ID, status.to_json())
        self._status, self._provisioning = status, provisioning(fleet)

    def reading(self) -> Reading:
        """What the metrics show of this copy now (`autoscaler.metrics`). A leader that has not renewed its lease
        within its TTL (the store is unreachable) no longer says it leads, nor shows its last fleet: another copy
        may hold the lease by now, and the fleet has moved on."""
        renewed = self._lease_renewed_at
        leading = (self.is_leader and renewed is not None
                   and self._clock.now() - renewed < self.settings.lease_ttl_s)
        return Reading(leader=leading, store_up=not self._store_outage.ongoing,
                       last_tick_at=self._reached_store_at, pools=tuple(sorted(self._snapshots.current.pools)),
                       status=self._status if leading else None,
                       provisioning=self._provisioning if leading else ())

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
        return self._log_event(Event(self._clock.wall(), model, kind, message))

    @staticmethod
    def _log_event(event: Event) -> Event:
        log.info("%s%s: %s", f"{event.model}: " if event.model else "", event.kind.value, event.message)
        return event
