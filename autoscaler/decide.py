"""One autoscaler tick's decision, pure: the same function in the live loop and in the simulator.

    tick = decide(spec, state, inputs)      # inputs: what the shell gathered; tick.state: for the next call

The live loop (`loop.py`) gathers `TickInputs` (the reconciled fleet, gateway totals, offerings, and
what became of the last tick's actions), calls `decide`, performs `tick.actions` in order and feeds
what it saw of them back as `Outcome`s at the next tick. The simulator (`sim/engine.py`) does the same
over simulated nodes and replicas, so drains, start back-off, failure handling and the node planner are
replayed exactly, for every policy: only the replica-count step differs (`ReplicaStep`).

One tick, in order:
1. **Outcomes** of the last tick's actions: a finished stop ends a drain (`Unpublish`); a failed stop is
   retried; a node refused for insufficient capacity is skipped for the ICE TTL; a start refused for
   good backs the model's starts off.
2. **Failures**: an interrupted node is reported once; a failed replica is retired from routing, its
   drain forgotten, its model's starts backed off (not for a preempted node: not the replica's fault)
   and the provider told to clean it up (`CleanUp`). A replica becoming ready resets the back-off.
3. **Drains** whose notice is over: `BeginStop` (the provider's `stop_replica`, which lets in-flight
   requests finish); its end comes back as an outcome.
4. **Replica counts**: the replica step per autoscaled model, over `model_observation`.
5. **Nodes**: `plan_nodes` over every model, draining and stopped replicas left out; nothing is planned
   while a pool could not be listed (deciding on a partial view would buy twice what runs there). Its
   actions are filtered: starts of a backed-off model are held; `StopReplica` becomes a drain (routers see
   DRAINING `drain_notice_s` before the stop). Draining replicas are `leaving` to the planner: they hold
   their GPUs and their node until they stop, and count for no model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Union

from kvgate.autoscaler.fleet import Backoff, autoscaled_models, booting_by_model, cold_start_s, model_observation
from kvgate.autoscaler.observe import GatewayTotals
from kvgate.autoscaler.planner import (CreateNode, DeleteNode, NodeAction, PlannerInputs, PlannerSettings, PlannerState,
                                       StartReplica, StopReplica, Unschedulable, note_insufficient_capacity, plan_nodes)
from kvgate.autoscaler.reconciler import Fleet
from kvgate.autoscaler.demand import ModelObservation, ScalerSpec
from kvgate.autoscaler.scaler import ReplicaDecision, ScalerState, decide_replicas
from kvgate.autoscaler.status import Event, EventKind
from kvgate.providers.base import NodeState, Offering, OfferingKey, ReplicaHandle, ReplicaState
from kvgate.registry.snapshot import Snapshot


class ReplicaStep(Protocol):
    """One model's replica count for this tick: (snapshot, model, its step state or None at first, observation,
    now) -> (new step state, decision). kvgate's is `kvgate_replicas`; the simulator plugs in baselines."""

    def __call__(self, snapshot: Snapshot, model: str, state: Any, obs: ModelObservation,
                 now: float) -> tuple[Any, ReplicaDecision]: ...


def kvgate_replicas(snapshot: Snapshot, model: str, state: ScalerState | None, obs: ModelObservation,
                    now: float) -> tuple[ScalerState, ReplicaDecision]:
    """kvgate's replica step: `decide_replicas` with the model's registry spec and its cold start."""
    doc = snapshot.models[model]
    return decide_replicas(ScalerSpec.of(doc, cold_start_s(snapshot, doc)), state or ScalerState(), obs, now)


@dataclass(frozen=True, slots=True)
class DecideSpec:
    """What a decision is made with besides its inputs: the loop's knobs and the replica step."""

    drain_notice_s: float = 2.0  # routers see DRAINING this long before the replica is told to stop
    backoff_base_s: float = 5.0  # first retry after a failed replica start; doubles per failure
    backoff_max_s: float = 300.0
    planner: PlannerSettings = PlannerSettings()
    id_prefix: str = "kvg"  # the planner's claim and replica ids: unique per autoscaler incarnation
    replicas: ReplicaStep = kvgate_replicas


@dataclass(frozen=True, slots=True)
class Drain:
    """A replica routers see as DRAINING: told to stop from `stop_at` (monotonic seconds)."""

    replica: ReplicaHandle
    pool: str
    stop_at: float
    stopping: bool = False  # `BeginStop` was issued and has not come back


@dataclass(frozen=True, slots=True)
class LoopState:
    """What a leader remembers between ticks; a new term starts from `LoopState()`."""

    replica_steps: Mapping[str, Any] = field(default_factory=dict)  # model -> its replica step's state
    desired: Mapping[str, int] = field(default_factory=dict)  # model -> the count decided last tick
    planner: PlannerState = PlannerState()
    backoff: Mapping[str, Backoff] = field(default_factory=dict)
    failed_seen: frozenset[str] = frozenset()  # failed replicas already handled
    preempted_seen: frozenset[str] = frozenset()  # interrupted nodes already reported
    draining: Mapping[str, Drain] = field(default_factory=dict)  # replica id -> its drain
    unschedulable: Mapping[str, str] = field(default_factory=dict)  # model -> the reason last reported


# ------------------------------------------------------------------------------ what the shell reports


@dataclass(frozen=True, slots=True)
class StopEnded:
    """A `BeginStop` finished: the replica is stopped, or `error` says why not (it is retried)."""

    replica_id: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CreateRefused:
    """A `CreateNode` the provider refused: for insufficient capacity (`insufficient` set), or for good."""

    model: str
    boots_replica: bool
    at: float  # monotonic seconds: a back-off counts from the refusal, and the ICE TTL from its wall time
    at_wall: float
    insufficient: OfferingKey | None = None
    retryable: bool = True


@dataclass(frozen=True, slots=True)
class StartRefused:
    """A `StartReplica` the provider refused; `retryable` False backs the model's starts off."""

    model: str
    retryable: bool
    at: float  # monotonic seconds: the back-off counts from the refusal


Outcome = Union[StopEnded, CreateRefused, StartRefused]


@dataclass(frozen=True, slots=True)
class TickInputs:
    """Everything one decision looks at. `now` is monotonic seconds (scaler, drains, back-off); `wall` is
    wall-clock seconds (the planner's timeline, `Node.launched_at`, and events)."""

    snapshot: Snapshot
    fleet: Fleet
    totals: Mapping[str, GatewayTotals]
    offerings: tuple[Offering, ...]
    now: float
    wall: float
    outcomes: tuple[Outcome, ...] = ()


# ------------------------------------------------------------------------------ what the shell performs


@dataclass(frozen=True, slots=True)
class Retire:
    """Put out one last DRAINING record for a replica leaving for good (failed, or its node is going)."""

    replica: ReplicaHandle
    pool: str | None


@dataclass(frozen=True, slots=True)
class CleanUp:
    """Tell the provider to stop a failed replica at once (no drain)."""

    replica_id: str
    model: str
    pool: str


@dataclass(frozen=True, slots=True)
class BeginStop:
    """The drain notice is over: `stop_replica`, letting in-flight requests finish; report a `StopEnded`."""

    replica_id: str
    model: str
    pool: str


@dataclass(frozen=True, slots=True)
class Unpublish:
    """The replica's drain ended: remove its membership record."""

    replica_id: str


Action = Union[Retire, CleanUp, BeginStop, Unpublish, CreateNode, DeleteNode, StartReplica]


@dataclass(frozen=True, slots=True)
class Tick:
    """`decide`'s answer: the next state, the actions in the order to perform them, and what was seen."""

    state: LoopState
    actions: tuple[Action, ...]
    decisions: Mapping[str, ReplicaDecision]
    observations: Mapping[str, ModelObservation]
    events: tuple[Event, ...]
    stopped: frozenset[str]  # replicas whose stop ended: they may still be listed this tick, publish nothing for them
    planned: bool  # False: a pool could not be listed, no node was planned


def decide(spec: DecideSpec, state: LoopState, inputs: TickInputs) -> Tick:
    """One tick's decision (module docstring). Pure: the same inputs give the same tick."""
    work = _Work(spec, inputs, state)
    work.apply_outcomes()
    work.handle_failures()
    work.begin_due_stops()
    decisions, observations = work.count_replicas()
    planned = not inputs.fleet.unreachable_pools
    if planned:
        work.plan({name: d.desired for name, d in decisions.items()})
    return Tick(work.state(), tuple(work.actions), decisions, observations, tuple(work.events),
                frozenset(work.stopped), planned)


class _Work:
    """One call's working copy of the state; never outlives `decide`."""

    def __init__(self, spec: DecideSpec, inputs: TickInputs, state: LoopState) -> None:
        self.spec, self.inputs = spec, inputs
        self.fleet = inputs.fleet
        self.pool_of = {node.id: node.pool for node in inputs.fleet.nodes}
        self.steps = dict(state.replica_steps)
        self.desired = dict(state.desired)
        self.planner = state.planner
        self.backoff = dict(state.backoff)
        self.failed_seen, self.preempted_seen = state.failed_seen, state.preempted_seen
        self.draining = dict(state.draining)
        self.unschedulable = dict(state.unschedulable)
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.stopped: set[str] = set()
        for exc in inputs.fleet.insufficient:  # claims the reconciler re-drove into a stockout
            self.note_stockout(exc.offering)

    def state(self) -> LoopState:
        return LoopState(self.steps, self.desired, self.planner, self.backoff, self.failed_seen, self.preempted_seen,
                         self.draining, self.unschedulable)

    def event(self, model: str | None, kind: EventKind, message: str) -> None:
        self.events.append(Event(self.inputs.wall, model, kind, message))

    def note_stockout(self, key: OfferingKey, wall: float | None = None) -> None:
        wall = self.inputs.wall if wall is None else wall
        self.planner = note_insufficient_capacity(self.planner, key, wall, self.spec.planner.ice_ttl_s)

    def back_off(self, model: str, at: float | None = None) -> Backoff:
        at = self.inputs.now if at is None else at
        backoff = self.backoff.get(model, Backoff()).after_failure(at, self.spec.backoff_base_s,
                                                                   self.spec.backoff_max_s)
        self.backoff[model] = backoff
        return backoff

    def may_start(self, model: str) -> bool:
        return self.backoff.get(model, Backoff()).may_start(self.inputs.now)

    # -- 1. outcomes

    def apply_outcomes(self) -> None:
        for outcome in self.inputs.outcomes:
            if isinstance(outcome, StopEnded):
                drain = self.draining.get(outcome.replica_id)
                if drain is None:
                    continue
                model = drain.replica.model
                if outcome.error is not None:
                    self.draining[outcome.replica_id] = replace(drain, stopping=False)
                    self.event(model, EventKind.PROVIDER_ERROR, f"stop {outcome.replica_id}: {outcome.error}; retrying")
                    continue
                del self.draining[outcome.replica_id]
                self.stopped.add(outcome.replica_id)
                self.actions.append(Unpublish(outcome.replica_id))
                self.event(model, EventKind.REPLICA_STOP, f"stopped {outcome.replica_id}")
            elif isinstance(outcome, CreateRefused):
                if outcome.insufficient is not None:
                    self.note_stockout(outcome.insufficient, outcome.at_wall)
                elif outcome.boots_replica and not outcome.retryable:
                    # Refused for good (a launch EC2 will never accept): back off as for a failed start, or the
                    # planner asks for the same node again every tick.
                    self.back_off(outcome.model, outcome.at)
            elif isinstance(outcome, StartRefused) and not outcome.retryable:
                self.back_off(outcome.model, outcome.at)

    # -- 2. failures

    def handle_failures(self) -> None:
        fleet = self.fleet
        interrupted = {n.id for n in fleet.nodes if n.state is NodeState.INTERRUPTED}
        for node in fleet.nodes:
            if node.id in interrupted and node.id not in self.preempted_seen:
                self.event(node.model, EventKind.PREEMPTED,
                           f"node {node.id} ({node.instance_type}, {node.capacity_type.value}): "
                           f"{node.reason or 'interrupted'}")
        self.preempted_seen = frozenset(interrupted)
        failed_seen = set(self.failed_seen) & {r.id for r in fleet.replicas}  # forgotten once no longer listed
        for replica in fleet.replicas:
            if replica.state is ReplicaState.READY:
                self.backoff.pop(replica.model, None)
            if replica.state is not ReplicaState.FAILED or replica.id in failed_seen:
                continue
            failed_seen.add(replica.id)
            pool = self.pool_of.get(replica.node_id)
            self.actions.append(Retire(replica, pool))
            self.draining.pop(replica.id, None)
            if replica.node_id in interrupted:
                continue  # the node was preempted: not the replica's fault, no back-off
            backoff = self.back_off(replica.model)
            self.event(replica.model, EventKind.REPLICA_FAILED,
                       f"{replica.id} failed: {replica.reason or 'no reason given'}; "
                       f"next start in {backoff.retry_at - self.inputs.now:.0f}s")
            if pool is not None:
                self.actions.append(CleanUp(replica.id, replica.model, pool))
        self.failed_seen = frozenset(failed_seen)

    # -- 3. drains

    def begin_due_stops(self) -> None:
        for replica_id, drain in sorted(self.draining.items()):
            if not drain.stopping and self.inputs.now >= drain.stop_at:
                self.draining[replica_id] = replace(drain, stopping=True)
                self.actions.append(BeginStop(replica_id, drain.replica.model, drain.pool))

    # -- 4. replica counts

    def count_replicas(self) -> tuple[dict[str, ReplicaDecision], dict[str, ModelObservation]]:
        inputs = self.inputs
        booting = booting_by_model(self.fleet.nodes, self.fleet.claims.values(), self.fleet.replicas)
        leaving = frozenset(self.draining) | frozenset(self.stopped)
        decisions: dict[str, ReplicaDecision] = {}
        observations: dict[str, ModelObservation] = {}
        models = autoscaled_models(inputs.snapshot)
        for name in models:
            obs = model_observation(name, inputs.totals.get(name), self.fleet.replicas, leaving, booting.get(name, 0))
            self.steps[name], decision = self.spec.replicas(inputs.snapshot, name, self.steps.get(name), obs,
                                                            inputs.now)
            before = self.desired.get(name, obs.ready_replicas + obs.starting_replicas)
            if decision.desired != before:
                kind = EventKind.SCALE_UP if decision.desired > before else EventKind.SCALE_DOWN
                self.event(name, kind, f"{before} -> {decision.desired}: {decision.reason}")
            self.desired[name] = decision.desired
            decisions[name], observations[name] = decision, obs
        for gone in set(self.steps) - set(models):  # a reload removed the model or made its replicas static
            del self.steps[gone]
            self.desired.pop(gone, None)
        return decisions, observations

    # -- 5. nodes

    def plan(self, desired: Mapping[str, int]) -> None:
        fleet, inputs = self.fleet, self.inputs
        planner_inputs = PlannerInputs(
            snapshot=inputs.snapshot, desired=desired, nodes=fleet.nodes,
            replicas=tuple(r for r in fleet.replicas
                           if r.id not in self.draining and r.id not in self.stopped
                           and r.state in (ReplicaState.STARTING, ReplicaState.READY)),
            leaving=tuple(r for r in fleet.replicas if r.id in self.draining),
            offerings=inputs.offerings,
            claims=tuple(r.claim for r in fleet.claims.values() if r.node_id not in self.pool_of),
            settings=self.spec.planner, id_prefix=self.spec.id_prefix)
        self.planner, actions = plan_nodes(planner_inputs, self.planner, inputs.wall)
        unschedulable = {a.model for a in actions if isinstance(a, Unschedulable)}
        self.unschedulable = {m: r for m, r in self.unschedulable.items() if m in unschedulable}
        for action in actions:
            self.take(action)

    def take(self, action: NodeAction) -> None:
        """One planner action, as it stands after the loop's own rules (module docstring, step 5)."""
        if isinstance(action, CreateNode):
            if not action.boots_replica or self.may_start(action.claim.model or ""):
                self.actions.append(action)
        elif isinstance(action, StartReplica):
            if self.may_start(action.model) and action.model in self.inputs.snapshot.models:
                self.actions.append(action)
        elif isinstance(action, DeleteNode):
            self.delete_node(action)
        elif isinstance(action, StopReplica):
            replica = next((r for r in self.fleet.replicas if r.id == action.replica_id), None)
            pool = self.pool_of.get(action.node_id)
            if replica is not None and pool is not None and replica.id not in self.draining:
                self.draining[replica.id] = Drain(replica, pool, self.inputs.now + self.spec.drain_notice_s)
                self.event(action.model, EventKind.REPLICA_DRAIN, f"draining {replica.id}: {action.reason}")
        elif isinstance(action, Unschedulable):
            if self.unschedulable.get(action.model) != action.reason:
                self.unschedulable[action.model] = action.reason
                self.event(action.model, EventKind.INSUFFICIENT_CAPACITY,
                           f"{action.replicas} replica(s) fit nowhere: {action.reason}")

    def delete_node(self, action: DeleteNode) -> None:
        """The node goes (the planner waits for drains there, but a preempted node is gone already): whatever is
        still listed on it is retired from routing, its drains forgotten."""
        node = next((n for n in self.fleet.nodes if n.id == action.node_id), None)
        for replica in self.fleet.replicas:
            if replica.node_id != action.node_id:
                continue
            if replica.state in (ReplicaState.STARTING, ReplicaState.READY) and replica.id not in self.stopped:
                # FAILED ones were retired in handle_failures; stopped ones were drained first.
                self.actions.append(Retire(replica, node.pool if node is not None else None))
            self.draining.pop(replica.id, None)
        self.actions.append(action)
