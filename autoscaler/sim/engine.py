"""The discrete-event loop: a trace against a replica fleet whose size a policy decides, on a fake clock.

Time is simulated: nothing sleeps and nothing reads a clock; one hour of the Azure trace replays in
about a second. Events, in time order (ties in the order they were scheduled):
- an arrival joins the gateway queue (one FIFO queue: the router's least-loaded choice over replicas);
- the queue is dispatched whenever a ready replica has a free batch slot, to the replica whose prefill
  engine frees up first; the request's first token comes when its prefill ends (`service.py`);
- a finished request frees its slot; a draining replica with nothing left is released;
- a replica started at t becomes ready at t + cold start (node boot + model load);
- a spot replica may be interrupted (seeded exponential lifetimes): it is gone at once, its requests
  that had no first token yet go back to the head of the queue, and the policy sees one replica fewer;
- every `policy.tick_s` the policy observes (the same `ModelObservation` the live loop builds) and
  returns a desired count; the fleet is moved toward it: draining replicas are taken back first, then
  new ones started (on-demand up to the model's on-demand base, spot beyond it where allowed, the
  cheapest available placement, on-demand when spot is stocked out); when shrinking, starting replicas
  are cancelled first, then the ready ones with the fewest requests drain (no request is dropped).
  With `FleetSetup.nodes` set, the live node planner places them instead, on simulated nodes (`nodes.py`).

GPU time is charged from a replica's start (a node is bought) to its release; a run ends
`tail_s` after the last arrival, and requests without a first token by then count as SLO misses.
With `score_from_s` > 0 the run before it is a warm-up: policies see it, but requests arriving in it,
GPU time, cold starts and scaling actions before it are not counted, and the timeline starts there.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.autoscaler.planner import (CreateNode, DeleteNode, PlannerInputs, PlannerState, StartReplica, StopReplica,
                                note_insufficient_capacity, plan_nodes)
from kvgate.autoscaler.scaler import ModelObservation
from kvgate.autoscaler.sim.nodes import NodePlanning, SimNode
from kvgate.autoscaler.sim.service import Placement, choose_placement
from kvgate.autoscaler.sim.traces import Trace
from kvgate.providers.base import NodeState, ReplicaHandle, ReplicaState
from kvgate.registry.schema import CapacityType

# Event kinds, in the order they run when due at the same instant (frees before starts before ticks).
_FREE, _READY, _NODE_UP, _PREEMPT, _NODE_PREEMPT, _TICK = 0, 1, 2, 3, 4, 5
# The gateway reports arrivals per second over this many seconds (router/observe does the same).
_RATE_WINDOW_S = 10
# With node planning, the planner runs at a tick when anything it sees changed (the desired count, a
# node or replica state), and at least this often otherwise (time alone moves the empty-node grace,
# the ICE cache and consolidation): identical ticks in between would return nothing new, and skipping
# them keeps the replay fast.
_PLAN_EVERY_S = 10.0


@dataclass(frozen=True)
class SimDecision:
    desired: int
    panic: bool = False
    forecast_rps: float | None = None
    reason: str = ""


class Policy(Protocol):
    """A replica-count policy: `decide` is pure over (state, observation, now); the engine keeps the state."""

    name: str
    tick_s: float

    def initial_state(self) -> Any: ...

    def decide(self, state: Any, obs: ModelObservation, now: float) -> tuple[Any, SimDecision]: ...


@dataclass(frozen=True)
class Stockout:
    """Placements whose key starts with `key_prefix` (pool/instance_type/capacity) sell nothing in [start_s, end_s)."""

    key_prefix: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Scenario:
    """What the world does to the fleet: spot interruptions and stockouts. Seeded, so runs repeat."""

    spot_interruptions_per_hour: float = 0.0  # per spot replica, or per spot node where nodes are planned (kvgate)
    stockouts: tuple[Stockout, ...] = ()
    seed: int = 0


@dataclass(frozen=True)
class FleetSetup:
    """The model's fleet: where replicas may run, its limits and its SLO."""

    model: str
    placements: tuple[Placement, ...]  # cheapest first (service.placements)
    min_replicas: int
    max_replicas: int
    on_demand_base: int  # replicas kept on on-demand; spot beyond it (placements hold spot only if allowed)
    ttft_slo_s: float
    initial_replicas: int = 0  # ready at t=0 on the cheapest on-demand-first placements (warm start)
    tail_s: float = 120.0
    nodes: NodePlanning | None = None  # set: the live node planner places replicas on simulated nodes


@dataclass(frozen=True)
class TimelinePoint:
    t: float
    arrivals_per_s: float
    ongoing: int  # queued + in flight: the demand
    ready: int
    active: int  # ready + starting (what the policy has asked for and not released)
    desired: int
    panic: bool


@dataclass(frozen=True)
class RunResult:
    """Everything one policy's run produced. TTFTs are in request order; NaN = never got a first token."""

    policy: str
    ttft_s: tuple[float, ...]
    gpu_seconds: float
    cost_usd: float
    cold_starts: int
    scaling_actions: int  # ticks at which the desired count changed
    preemptions: int
    duration_s: float
    timeline: tuple[TimelinePoint, ...]
    max_replicas: int


@dataclass
class _Replica:
    id: int
    placement: Placement
    started_at: float
    ready_at: float
    state: str = "starting"  # starting | ready | draining | gone
    in_flight: set[int] = field(default_factory=set)
    prefill_free_at: float = 0.0
    max_batch: int = 0  # copied from the placement's service model: read on every dispatch
    node: SimNode | None = None  # the node it runs on (node planning only; then the node is charged)
    handle: str = ""  # the planner's replica id (node planning only)

    def __post_init__(self) -> None:
        self.max_batch = self.placement.service.max_batch


class _Run:
    """One run's mutable world. Private: `simulate` is the interface."""

    def __init__(self, trace: Trace, fleet: FleetSetup, policy: Policy, scenario: Scenario,
                 score_from_s: float) -> None:
        self.trace, self.fleet, self.policy, self.scenario = trace, fleet, policy, scenario
        self.score_from = score_from_s
        self.rng = random.Random(scenario.seed)
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, a, b)
        self.seq = 0
        self.queue: deque[int] = deque()
        self.replicas: dict[int, _Replica] = {}
        self.next_replica = 0
        n = len(trace.requests)
        self.ttft = [math.nan] * n
        self.attempt = [0] * n
        self.first_token_at = [math.inf] * n
        self.holder = [-1] * n  # replica id holding each request
        self.arrivals_per_second: list[int] = [0] * (int(trace.duration_s) + 2)
        self.prompt_tokens_per_second: list[int] = [0] * (int(trace.duration_s) + 2)
        self.prompt_squares_per_second: list[int] = [0] * (int(trace.duration_s) + 2)
        self.gpu_seconds = self.cost_usd = 0.0
        self.cold_starts = self.actions = self.preemptions = self.peak = 0
        self.timeline: list[TimelinePoint] = []
        self.ready: list[_Replica] | None = None  # replicas in state "ready"; None: to be rebuilt
        self.end = trace.duration_s + fleet.tail_s
        self.nodes: dict[str, SimNode] = {}
        self.node_serials: dict[int, SimNode] = {}
        self.next_node = 0
        self.by_handle: dict[str, _Replica] = {}
        self.planner = PlannerState()
        self.planned: tuple[float, int] | None = None  # (when, desired) of the last planner tick
        self.fleet_changed = True
        self.placement_of = {p.key: p for p in fleet.placements}
        self.policy_state: Any = policy.initial_state()
        self.last_desired: int | None = None  # the count of the last tick, to count scaling actions

    # ---------------------------------------------------------------------------------------- events

    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, a, b))

    def run(self) -> RunResult:
        requests = self.trace.requests
        self.open_fleet()
        self.push(0.0, _TICK)
        i = 0
        while True:
            next_event = self.events[0][0] if self.events else math.inf
            next_arrival = requests[i].arrival_s if i < len(requests) else math.inf
            now = min(next_event, next_arrival)
            if now > self.end:
                break
            if next_arrival <= next_event:
                self.queue.append(i)
                self.arrivals_per_second[int(now)] += 1
                self.prompt_tokens_per_second[int(now)] += requests[i].input_tokens
                self.prompt_squares_per_second[int(now)] += requests[i].input_tokens ** 2
                i += 1
                self.dispatch(now)
                continue
            _, kind, _, a, b = heapq.heappop(self.events)
            self.handle(now, kind, a, b)
        return self.close()

    def open_fleet(self) -> None:
        """The run's opening fleet, ready at t=0 (`FleetSetup.initial_replicas`)."""
        if self.fleet.nodes is not None:
            self.plan(0.0, self.fleet.initial_replicas, warm=True)  # buys the nodes, RUNNING at once
            self.plan(0.0, self.fleet.initial_replicas, warm=True)  # starts the replicas, ready at once
        else:
            for _ in range(self.fleet.initial_replicas):
                self.start_replica(0.0, warm=True)

    def handle(self, now: float, kind: int, a: int, b: int) -> None:
        """Run one due event (`push`'s kind and arguments)."""
        if kind == _FREE:
            self.finish(now, a, b)
        elif kind == _READY:
            self.become_ready(now, a)
        elif kind == _PREEMPT:
            self.preempt(now, a)
        elif kind == _NODE_UP:
            node = self.node_serials.get(a)
            if node is not None and node.state is NodeState.PENDING:
                node.state = NodeState.RUNNING
                self.fleet_changed = True
        elif kind == _NODE_PREEMPT:
            self.preempt_node(now, a)
        else:
            self.tick(now)

    def tick(self, now: float) -> None:
        """The policy observes and decides; the fleet is moved toward its count; the next tick is due."""
        self.policy_state, decision = self.policy.decide(self.policy_state, self.observe(now), now)
        desired = min(self.fleet.max_replicas, max(self.fleet.min_replicas, decision.desired))
        if self.last_desired is not None and desired != self.last_desired and now >= self.score_from:
            self.actions += 1
        self.last_desired = desired
        if self.fleet.nodes is not None:
            if (self.fleet_changed or self.planned is None or self.planned[1] != desired
                    or now - self.planned[0] >= _PLAN_EVERY_S):
                self.plan(now, desired)
        else:
            self.scale_to(now, desired)
        if now >= self.score_from:
            self.record(now, desired, decision.panic)
        self.push(now + self.policy.tick_s, _TICK)

    def close(self) -> RunResult:
        """Release everything at the end of the run (charging it) and score the requests after warm-up."""
        for replica in list(self.replicas.values()):
            self.release(self.end, replica)
        for node in list(self.nodes.values()):
            self.release_node(self.end, node)
        scored = tuple(t for t, r in zip(self.ttft, self.trace.requests) if r.arrival_s >= self.score_from)
        return RunResult(self.policy.name, scored, self.gpu_seconds, self.cost_usd, self.cold_starts,
                         self.actions, self.preemptions, self.end - self.score_from, tuple(self.timeline), self.peak)

    # ------------------------------------------------------------------------------------- requests

    def dispatch(self, now: float) -> None:
        while self.queue:
            if self.ready is None:  # rebuilt only after a replica changed state: rare next to requests
                self.ready = [r for r in self.replicas.values() if r.state == "ready"]
            best: _Replica | None = None
            best_free_at = math.inf
            for replica in self.ready:
                if replica.prefill_free_at < best_free_at and len(replica.in_flight) < replica.max_batch:
                    best, best_free_at = replica, replica.prefill_free_at
            if best is None:
                return
            index = self.queue.popleft()
            request = self.trace.requests[index]
            service = best.placement.service
            first = max(now, best.prefill_free_at) + service.prefill_s(request.input_tokens)
            best.prefill_free_at = first
            best.in_flight.add(index)
            self.holder[index] = best.id
            self.first_token_at[index] = first
            self.ttft[index] = first - request.arrival_s
            self.push(first + service.decode_s(request.output_tokens), _FREE, index, self.attempt[index])

    def finish(self, now: float, index: int, attempt: int) -> None:
        if attempt != self.attempt[index]:
            return  # the replica that held it was interrupted; it was re-queued under a new attempt
        replica = self.replicas.get(self.holder[index])
        if replica is None or index not in replica.in_flight:
            return
        replica.in_flight.discard(index)
        if replica.state == "draining" and not replica.in_flight:
            self.release(now, replica)
        else:
            self.dispatch(now)

    def preempt(self, now: float, replica_id: int) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        self.preemptions += now >= self.score_from
        self.evict(now, replica)

    def evict(self, now: float, replica: _Replica) -> None:
        """The replica is gone at once (its machine was taken): requests still waiting for a first token
        start over elsewhere; ones already streaming are lost mid-answer (the client saw the first token)."""
        retry = sorted((i for i in replica.in_flight if self.first_token_at[i] > now), reverse=True)
        for index in retry:
            self.attempt[index] += 1
            self.ttft[index] = math.nan
            self.first_token_at[index] = math.inf
            self.queue.appendleft(index)
        replica.in_flight.clear()
        self.release(now, replica)
        self.dispatch(now)

    # ------------------------------------------------------------------------------------- replicas

    def start_replica(self, now: float, *, warm: bool = False) -> bool:
        unavailable = frozenset(p.key for p in self.fleet.placements for s in self.scenario.stockouts
                                if s.start_s <= now < s.end_s and p.key.startswith(s.key_prefix))
        on_demand = sum(1 for r in self.replicas.values() if r.state in ("starting", "ready")
                        and r.placement.capacity_type is CapacityType.ON_DEMAND)
        placement = choose_placement(self.fleet.placements, spot=on_demand >= self.fleet.on_demand_base,
                                     unavailable=unavailable)
        if placement is None:
            return False
        replica = _Replica(self.next_replica, placement, started_at=now,
                           ready_at=now if warm else now + placement.cold_start_s)
        self.add_replica(now, replica, warm)
        rate = self.scenario.spot_interruptions_per_hour
        if placement.capacity_type is CapacityType.SPOT and rate > 0:
            self.push(now + self.rng.expovariate(rate / 3600.0), _PREEMPT, replica.id)
        return True

    def add_replica(self, now: float, replica: _Replica, warm: bool) -> None:
        """Count a new replica in: ready at once when warm (the run's opening fleet), else a cold start
        that becomes ready at `replica.ready_at`."""
        self.next_replica += 1
        self.replicas[replica.id] = replica
        if warm:
            replica.state = "ready"
            self.ready = None
        else:
            self.cold_starts += now >= self.score_from
            self.push(replica.ready_at, _READY, replica.id)

    def become_ready(self, now: float, replica_id: int) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None and replica.state == "starting":  # not cancelled or preempted meanwhile
            replica.state = "ready"
            self.ready = None
            replica.prefill_free_at = now
            self.fleet_changed = True
            self.dispatch(now)

    def release(self, now: float, replica: _Replica) -> None:
        if replica.node is None:  # with node planning the node is charged instead (release_node)
            lifetime = max(0.0, now - max(replica.started_at, self.score_from))
            self.gpu_seconds += lifetime * replica.placement.gpus
            self.cost_usd += lifetime * replica.placement.price_usd_per_hour / 3600.0
        else:
            replica.node.replicas.discard(replica.id)
            self.by_handle.pop(replica.handle, None)
        replica.state = "gone"
        self.fleet_changed = True
        del self.replicas[replica.id]
        self.ready = None

    def scale_to(self, now: float, desired: int) -> None:
        live = [r for r in self.replicas.values() if r.state in ("starting", "ready")]
        missing = desired - len(live)
        if missing > 0:
            # Taking back a draining replica is instant capacity; the busiest one has the warmest cache.
            for replica in sorted((r for r in self.replicas.values() if r.state == "draining"),
                                  key=lambda r: -len(r.in_flight))[:missing]:
                replica.state = "ready"
                self.ready = None
                missing -= 1
            while missing > 0 and self.start_replica(now):
                missing -= 1
        elif missing < 0:
            # Cancel what is still starting (newest first: least sunk time), then drain the idlest ready ones,
            # spot before on-demand so the on-demand base stays.
            starting = sorted((r for r in live if r.state == "starting"), key=lambda r: -r.started_at)
            ready = sorted((r for r in live if r.state == "ready"),
                           key=lambda r: (r.placement.capacity_type is CapacityType.ON_DEMAND, len(r.in_flight)))
            for replica in (starting + ready)[:-missing]:
                self.stop(now, replica)
        self.settle(now)

    def stop(self, now: float, replica: _Replica) -> None:
        """Cancel a replica still starting or idle; else let it drain its in-flight requests."""
        if replica.state == "starting" or not replica.in_flight:
            self.release(now, replica)
        else:
            replica.state = "draining"
            self.ready = None

    def settle(self, now: float) -> None:
        """After a scaling step: note the peak (once scoring started) and hand out queued requests."""
        if now >= self.score_from:
            self.peak = max(self.peak, len(self.replicas))
        self.dispatch(now)

    # ---------------------------------------------------------------------- nodes (the live planner)

    def plan(self, now: float, desired: int, *, warm: bool = False) -> None:
        """One `plan_nodes` tick over the sim's nodes and replicas, and its actions performed.

        Draining replicas are left out of the planner's input, as the live loop leaves them out.
        `warm`: bought nodes are RUNNING and started replicas ready at once (the run's opening fleet).
        """
        setup = self.fleet.nodes
        assert setup is not None
        replicas = tuple(ReplicaHandle(r.handle, self.fleet.model, r.node.id, "", None,
                                       ReplicaState.READY if r.state == "ready" else ReplicaState.STARTING,
                                       r.started_at)
                         for r in self.replicas.values() if r.node is not None and r.state in ("starting", "ready"))
        inputs = PlannerInputs(setup.snapshot, {self.fleet.model: desired},
                               tuple(n.as_node() for n in self.nodes.values()), replicas, setup.offerings,
                               settings=setup.settings, id_prefix="sim")
        self.planner, actions = plan_nodes(inputs, self.planner, now)
        self.planned, self.fleet_changed = (now, desired), False
        for action in actions:
            if isinstance(action, CreateNode):
                self.create_node(now, action, warm)
            elif isinstance(action, DeleteNode):
                node = self.nodes.get(action.node_id)
                if node is not None:
                    self.release_node(now, node)
            elif isinstance(action, StartReplica):
                self.start_on_node(now, action, warm)
            elif isinstance(action, StopReplica):
                replica = self.by_handle.get(action.replica_id)
                if replica is not None:
                    self.stop(now, replica)
        self.settle(now)

    def create_node(self, now: float, action: CreateNode, warm: bool) -> None:
        setup = self.fleet.nodes
        assert setup is not None
        key = action.claim.offering
        prefix = f"{key.pool}/{key.instance_type}/{key.capacity_type.value}"
        if any(s.start_s <= now < s.end_s and prefix.startswith(s.key_prefix) for s in self.scenario.stockouts):
            # What the reconciler does when `create` raises InsufficientCapacity.
            self.planner = note_insufficient_capacity(self.planner, key, now, setup.settings.ice_ttl_s)
            self.fleet_changed = True  # the next tick's claim goes to the next cheapest offering
            return
        offering = next(o for o in setup.offerings if o.key == key)
        self.next_node += 1  # serials are never reused: a stale event must not hit a newer node
        node = SimNode(self.next_node, action.claim, offering, now)
        self.nodes[node.id] = node
        self.node_serials[node.serial] = node
        if warm:
            node.state = NodeState.RUNNING
        else:
            self.push(now + setup.node_boot_s[key.pool], _NODE_UP, node.serial)
        rate = self.scenario.spot_interruptions_per_hour
        if key.capacity_type is CapacityType.SPOT and rate > 0:
            self.push(now + self.rng.expovariate(rate / 3600.0), _NODE_PREEMPT, node.serial)

    def start_on_node(self, now: float, action: StartReplica, warm: bool) -> None:
        setup = self.fleet.nodes
        node = self.nodes.get(action.node_id)
        assert setup is not None and node is not None and node.state is NodeState.RUNNING
        o = node.offering
        placement = self.placement_of[f"{o.pool}/{o.instance_type}/{o.capacity_type.value}"]
        replica = _Replica(self.next_replica, placement, started_at=now,
                           ready_at=now if warm else now + setup.model_load_s, node=node, handle=action.replica_id)
        self.add_replica(now, replica, warm)
        self.by_handle[replica.handle] = replica
        node.replicas.add(replica.id)

    def preempt_node(self, now: float, serial: int) -> None:
        node = self.node_serials.get(serial)
        if node is None or node.id not in self.nodes or node.state is NodeState.INTERRUPTED:
            return
        self.fleet_changed = True
        node.state = NodeState.INTERRUPTED  # the planner deletes and replaces it on its next tick
        self.preemptions += now >= self.score_from
        for replica_id in sorted(node.replicas):
            self.evict(now, self.replicas[replica_id])
        self.dispatch(now)

    def release_node(self, now: float, node: SimNode) -> None:
        """Release `node`: whatever still runs on it is gone; all its GPUs are charged from purchase."""
        for replica_id in sorted(node.replicas):
            self.evict(now, self.replicas[replica_id])
        lifetime = max(0.0, now - max(node.launched_at, self.score_from))
        self.gpu_seconds += lifetime * node.offering.gpu_count
        self.cost_usd += lifetime * node.offering.price_usd_per_hour / 3600.0
        del self.nodes[node.id]
        del self.node_serials[node.serial]

    # ---------------------------------------------------------------------------------- observation

    def observe(self, now: float) -> ModelObservation:
        second = int(now)
        # Over the last 10 s, or over the time elapsed when less (a gateway that just started does the same).
        span = max(1, min(_RATE_WINDOW_S, second))
        window = self.arrivals_per_second[second - span:second] if second else []
        prompts = self.prompt_tokens_per_second[second - span:second] if second else []
        squares = self.prompt_squares_per_second[second - span:second] if second else []
        running = sum(len(r.in_flight) for r in self.replicas.values())
        mean = sum(window) / span
        return ModelObservation(
            model=self.fleet.model, queued_at_gateways=len(self.queue), waiting=0, running=running,
            arrivals_var=sum((n - mean) ** 2 for n in window) / span if window else None,
            arrivals_per_s=mean, prompt_tokens_per_s=sum(prompts) / span,
            prompt_tokens_sq_per_s=sum(squares) / span, ttft_p99_s=None,
            ready_replicas=sum(1 for r in self.replicas.values() if r.state == "ready"),
            starting_replicas=sum(1 for r in self.replicas.values() if r.state == "starting") + self.booking())

    def booking(self) -> int:
        """Replicas bought for nodes still booting (they count as starting, as pending claims do live)."""
        return sum(max(0, n.planned_replicas - len(n.replicas)) for n in self.nodes.values()
                   if n.state is NodeState.PENDING)

    def record(self, now: float, desired: int, panic: bool) -> None:
        obs = self.observe(now)
        self.timeline.append(TimelinePoint(now - self.score_from, obs.arrivals_per_s, obs.ongoing, obs.ready_replicas,
                                           obs.ready_replicas + obs.starting_replicas, desired, panic))


def simulate(trace: Trace, fleet: FleetSetup, policy: Policy, scenario: Scenario = Scenario(), *,
             score_from_s: float = 0.0) -> RunResult:
    """Replay `trace` against a fleet sized by `policy`; deterministic for a given scenario seed.

    Everything before `score_from_s` is warm-up (see the module docstring).
    """
    return _Run(trace, fleet, policy, scenario, score_from_s).run()
