"""The discrete-event loop: a trace against a replica fleet whose size a policy decides, on a fake clock.

Time is simulated: nothing sleeps and nothing reads a clock; one hour of the Azure trace replays in
about a second. Events, in time order (ties in the order they were scheduled):
- an arrival joins the gateway queue (one FIFO queue: the router's least-loaded choice over replicas);
- the queue is dispatched whenever a ready replica has a free batch slot, to the replica that would give
  the request its first token soonest; each replica runs its requests in engine steps, chunked prefill
  beside decode (`batching.py`): its first token comes at the end of the step that prefills the last of
  its prompt, its last token some decode steps later;
- a finished request frees its slot; a draining replica with nothing left is released;
- a replica started at t becomes ready at t + cold start (node boot + model load);
- a spot replica may be interrupted (seeded exponential lifetimes): it is gone at once, its requests
  that had no first token yet go back to the head of the queue, and the policy sees one replica fewer;
- every `policy.tick_s` the autoscaler ticks. With `FleetSetup.nodes` set (every `kvgate sim` run), that
  is the live loop's own decision, `autoscaler.decide.decide`, over the sim's nodes and replicas listed as a
  provider lists them, with the policy as its replica step: drains (routers see DRAINING, the stop comes
  `drain_notice_s` later and lets in-flight requests finish, up to `drain_timeout_s`), start back-off after
  failed starts (`Scenario.start_failure_rate`), failure handling and the node planner are the live ones
  (`nodes.py` says how each action is performed). Without nodes (the service model's own tests), the
  policy's count is applied directly: draining replicas are taken back first, then new ones started
  (on-demand up to the model's on-demand base, spot beyond it where allowed, the cheapest available
  placement, on-demand when spot is stocked out); when shrinking, starting replicas are cancelled first,
  then the ready ones with the fewest requests drain (no request is dropped).

With `FleetSetup.cluster` (no nodes: `kvgate sim --shared-slurm`), replicas take their GPUs from a Slurm cluster
they may share with a training backlog (`training.py`): a start that must preempt training waits for the grace
before its cold start, a start past the inference ceiling is refused, and a released replica's GPUs go back to the
training queue; `RunResult.cluster_use` has the cluster's GPU-hours.

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
from typing import Any

from kvgate.autoscaler.decide import (BeginStop, CleanUp, CreateRefused, LoopState, Outcome, StopEnded, TickInputs,
                                      decide)
from kvgate.autoscaler.observe import GatewayTotals
from kvgate.autoscaler.planner import (CreateNode, DeleteNode, PlannerInputs, PlannerState, StartReplica,
                                       plan_nodes)
from kvgate.autoscaler.reconciler import Fleet
from kvgate.autoscaler.demand import ModelObservation
from kvgate.autoscaler.sim.batching import ReplicaBatch
from kvgate.autoscaler.sim.nodes import SimNode
from kvgate.autoscaler.sim.records import FleetSetup, Policy, PolicyStep, RunResult, Scenario, TimelinePoint
from kvgate.autoscaler.sim.service import Placement, PrefixCache, choose_placement
from kvgate.autoscaler.sim.training import ClusterState, acquire, finish, open_cluster, release
from kvgate.autoscaler.sim.traces import Request, Trace
from kvgate.providers.base import NodeState, ReplicaHandle, ReplicaState
from kvgate.registry.schema import CapacityType
from kvgate.registry.snapshot import Snapshot

# Event kinds, in the order they run when due at the same instant (frees before starts before ticks).
_STEP, _READY, _NODE_UP, _PREEMPT, _NODE_PREEMPT, _STOP_DEADLINE, _TICK = range(7)
# The gateway reports arrivals per second over this many seconds (router/observe does the same).
_RATE_WINDOW_S = 10


@dataclass
class _Replica:
    id: int
    placement: Placement
    started_at: float
    ready_at: float
    state: str = "starting"  # starting | ready | failed | gone
    draining: bool = False  # routers send it nothing new
    stop_by: float | None = None  # told to stop (nodes only): gone once idle, or at this deadline whatever it holds
    in_flight: set[int] = field(default_factory=set)
    batch: ReplicaBatch = field(init=False)  # what it runs, step by step
    max_batch: int = 0  # copied from the placement's service model: read on every dispatch
    node: SimNode | None = None  # the node it runs on (node planning only; then the node is charged)
    handle: str = ""  # the planner's replica id (node planning only)
    cache: PrefixCache | None = None  # its prefix cache, for traces with block hashes (`_Run.add_replica`)

    def __post_init__(self) -> None:
        self.max_batch = self.placement.service.max_batch
        self.batch = ReplicaBatch(self.placement.service)


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
        self.first_token_at = [math.inf] * n
        self.arrivals_per_second: list[int] = [0] * (int(trace.duration_s) + 2)
        self.prompt_tokens_per_second: list[int] = [0] * (int(trace.duration_s) + 2)
        self.prompt_squares_per_second: list[int] = [0] * (int(trace.duration_s) + 2)
        self.completions_per_second: list[int] = [0] * (int(trace.duration_s + fleet.tail_s) + 2)
        self.gpu_seconds = self.cost_usd = 0.0
        self.cold_starts = self.actions = self.preemptions = self.peak = 0
        self.timeline: list[TimelinePoint] = []
        self.ready: list[_Replica] | None = None  # replicas in state "ready"; None: to be rebuilt
        self.end = trace.duration_s + fleet.tail_s
        self.nodes: dict[str, SimNode] = {}
        self.node_serials: dict[int, SimNode] = {}
        self.next_node = 0
        self.by_handle: dict[str, _Replica] = {}
        self.loop = LoopState()  # the live decision's state (nodes only)
        self.outcomes: list[Outcome] = []  # what the last tick's actions came to, for the next decision
        self.placement_of = {p.key: p for p in fleet.placements}
        self.policy_state: Any = policy.initial_state()
        self.caching = trace.block_tokens > 0
        self.last_desired: int | None = None  # the count of the last tick, to count scaling actions
        self.cluster: ClusterState | None = None  # who holds the Slurm cluster's GPUs (`FleetSetup.cluster` only)
        if fleet.cluster is not None and fleet.nodes is not None:
            raise ValueError("a fleet takes its GPUs from a Slurm cluster or from planned nodes, not both")

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
                # What the gateway counts: the prompt less the longest prefix a ready replica holds.
                uncached = self.uncached_tokens(requests[i], self.best_hold(requests[i]))
                self.prompt_tokens_per_second[int(now)] += uncached
                self.prompt_squares_per_second[int(now)] += uncached ** 2
                i += 1
                self.dispatch(now)
                continue
            _, kind, _, a, b = heapq.heappop(self.events)
            self.handle(now, kind, a, b)
        return self.close()

    def open_fleet(self) -> None:
        """The run's opening fleet, ready at t=0 (`FleetSetup.initial_replicas`)."""
        if self.fleet.nodes is not None:
            self.open_nodes(self.fleet.initial_replicas)
        else:
            for _ in range(self.fleet.initial_replicas):
                self.start_replica(0.0, warm=True)
            if self.fleet.cluster is not None:
                opening = {r.id: r.placement.gpus for r in self.replicas.values()}
                self.cluster = open_cluster(self.fleet.cluster, opening)

    def handle(self, now: float, kind: int, a: int, b: int) -> None:
        """Run one due event (`push`'s kind and arguments)."""
        if kind == _STEP:
            self.step(now, a, b)
        elif kind == _READY:
            self.become_ready(now, a)
        elif kind == _PREEMPT:
            self.preempt(now, a)
        elif kind == _NODE_UP:
            node = self.node_serials.get(a)
            if node is not None and node.state is NodeState.PENDING:
                node.state = NodeState.RUNNING
        elif kind == _NODE_PREEMPT:
            self.preempt_node(now, a)
        elif kind == _STOP_DEADLINE:
            replica = self.replicas.get(a)
            if replica is not None and replica.stop_by is not None:
                self.end_stop(now, replica)
        else:
            self.tick(now)

    def tick(self, now: float) -> None:
        """The autoscaler ticks (module docstring); the next tick is due."""
        if self.fleet.nodes is not None:
            desired, obs, panic = self.decide(now)
        else:
            obs = self.observe(now)
            self.policy_state, decision = self.policy.decide(self.policy_state, obs, now)
            desired, panic = min(self.fleet.max_replicas, max(self.fleet.min_replicas, decision.desired)), decision.panic
            self.scale_to(now, desired)
        if self.last_desired is not None and desired != self.last_desired and now >= self.score_from:
            self.actions += 1
        self.last_desired = desired
        if now >= self.score_from:
            placed = sum(1 for r in self.replicas.values() if not r.draining and r.state in ("starting", "ready"))
            self.timeline.append(TimelinePoint(now - self.score_from, obs.arrivals_per_s, obs.ongoing, obs.ready_replicas,
                                               obs.ready_replicas + obs.starting_replicas, desired, panic, placed))
        self.push(now + self.policy.tick_s, _TICK)

    def close(self) -> RunResult:
        """Release everything at the end of the run (charging it) and score the requests after warm-up."""
        for replica in list(self.replicas.values()):
            self.release(self.end, replica)
        for node in list(self.nodes.values()):
            self.release_node(self.end, node)
        use = finish(self.fleet.cluster, self.cluster, self.end) if self.fleet.cluster and self.cluster else None
        scored = tuple(t for t, r in zip(self.ttft, self.trace.requests) if r.arrival_s >= self.score_from)
        return RunResult(self.policy.name, scored, self.gpu_seconds, self.cost_usd, self.cold_starts,
                         self.actions, self.preemptions, self.end - self.score_from, tuple(self.timeline), self.peak,
                         use)

    # ------------------------------------------------------------------------------------- requests

    def dispatch(self, now: float) -> None:
        while self.queue:
            if self.ready is None:  # rebuilt only after a replica changed state: rare next to requests
                self.ready = [r for r in self.replicas.values() if r.state == "ready" and not r.draining]
            index = self.queue[0]
            request = self.trace.requests[index]
            best: _Replica | None = None
            best_key = (math.inf, math.inf)
            best_held = 0
            whole = max(1, request.input_tokens)
            for replica in self.ready:
                if len(replica.in_flight) >= replica.max_batch:
                    continue
                # The replica that gives the first token soonest (its prefill queue, and the prefix it holds); among
                # those as soon, the one running fewest.
                held, tokens = 0, whole
                if replica.cache is not None:
                    held = replica.cache.match(request.blocks)
                    tokens = self.uncached_tokens(request, held)
                key = (replica.batch.first_token_estimate(now, tokens), len(replica.in_flight))
                if key < best_key:
                    best, best_key, best_held = replica, key, held
            if best is None:
                return
            self.queue.popleft()
            if best.cache is not None:
                best.cache.insert(request.blocks)
            best.in_flight.add(index)
            next_at = best.batch.admit(now, index, self.uncached_tokens(request, best_held), request.output_tokens)
            if next_at is not None:
                self.push(next_at, _STEP, best.id, best.batch.version)

    def step(self, now: float, replica_id: int, version: int) -> None:
        """A replica's event: a step ended, or a sequence's last token came (`batching.py`)."""
        replica = self.replicas.get(replica_id)
        if replica is None or version != replica.batch.version:
            return  # gone, or the event moved since
        done = replica.batch.advance(now)
        for index in done.first_tokens:
            self.first_token_at[index] = now
            self.ttft[index] = now - self.trace.requests[index].arrival_s
        if done.next_at is not None:
            self.push(done.next_at, _STEP, replica.id, replica.batch.version)
        if done.ended:
            self.completions_per_second[min(int(now), len(self.completions_per_second) - 1)] += len(done.ended)
            for index in done.ended:
                replica.in_flight.discard(index)
            self.freed(now, replica)

    def uncached_tokens(self, request: Request, held_blocks: int) -> int:
        """The prompt tokens left to prefill after `held_blocks` cached blocks (at least one: the last token's
        logits are always computed)."""
        return max(1, request.input_tokens - held_blocks * self.trace.block_tokens)

    def best_hold(self, request: Request) -> int:
        """The longest prefix of `request` any ready replica holds, in blocks (what the router predicts)."""
        if not self.caching:
            return 0
        if self.ready is None:
            self.ready = [r for r in self.replicas.values() if r.state == "ready" and not r.draining]
        return max((r.cache.match(request.blocks) for r in self.ready if r.cache is not None), default=0)

    def freed(self, now: float, replica: _Replica) -> None:
        """Requests on `replica` ended: their slots go to the queue, or a draining replica left idle stops."""
        if replica.in_flight or not replica.draining:
            self.dispatch(now)
        elif replica.stop_by is not None:
            self.end_stop(now, replica)
        elif self.fleet.nodes is None:  # without nodes a drained replica is released at once
            self.release(now, replica)

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
            self.ttft[index] = math.nan
            self.first_token_at[index] = math.inf
            self.queue.appendleft(index)
        replica.in_flight.clear()
        replica.batch.clear()
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
        wait_s: float | None = 0.0
        if self.fleet.cluster is not None and self.cluster is not None:  # not the opening fleet: open_fleet counts it
            self.cluster, wait_s = acquire(self.fleet.cluster, self.cluster, now, self.next_replica, placement.gpus)
            if wait_s is None:
                return False  # the inference ceiling
        replica = _Replica(self.next_replica, placement, started_at=now,
                           ready_at=now if warm else now + wait_s + placement.cold_start_s)
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
        if self.caching and replica.placement.service.kv_cache_tokens:
            replica.cache = PrefixCache(replica.placement.service.kv_cache_tokens // self.trace.block_tokens)
        if warm:
            replica.state = "ready"
            self.ready = None
        else:
            self.cold_starts += now >= self.score_from
            self.push(replica.ready_at, _READY, replica.id)

    def become_ready(self, now: float, replica_id: int) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None or replica.state != "starting":  # cancelled or preempted meanwhile
            return
        if replica.node is not None and self.rng.random() < self.scenario.start_failure_rate:
            replica.state = "failed"  # listed FAILED: the decision retires it and backs the model's starts off
            return
        replica.state = "ready"
        self.ready = None
        self.dispatch(now)

    def release(self, now: float, replica: _Replica) -> None:
        if replica.node is None:  # with node planning the node is charged instead (release_node)
            lifetime = max(0.0, now - max(replica.started_at, self.score_from))
            self.gpu_seconds += lifetime * replica.placement.gpus
            self.cost_usd += lifetime * replica.placement.price_usd_per_hour / 3600.0
        else:
            replica.node.replicas.discard(replica.id)
            self.by_handle.pop(replica.handle, None)
        if self.fleet.cluster is not None and self.cluster is not None:
            self.cluster = release(self.fleet.cluster, self.cluster, now, replica.id)
        replica.state = "gone"
        del self.replicas[replica.id]
        self.ready = None

    def scale_to(self, now: float, desired: int) -> None:
        """Without nodes: move the fleet to `desired` replicas directly (module docstring)."""
        live = [r for r in self.replicas.values() if not r.draining]
        missing = desired - len(live)
        if missing > 0:
            # Taking back a draining replica is instant capacity; the busiest one has the warmest cache.
            for replica in sorted((r for r in self.replicas.values() if r.draining),
                                  key=lambda r: -len(r.in_flight))[:missing]:
                replica.draining = False
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
                if replica.state == "starting" or not replica.in_flight:
                    self.release(now, replica)
                else:
                    replica.draining = True
                    self.ready = None
        self.settle(now)

    def settle(self, now: float) -> None:
        """After a scaling step: note the peak (once scoring started) and hand out queued requests."""
        if now >= self.score_from:
            self.peak = max(self.peak, len(self.replicas))
        self.dispatch(now)

    # ------------------------------------------------------------------- nodes (the live decision)

    def open_nodes(self, desired: int) -> None:
        """The opening fleet, warm: the planner buys nodes RUNNING at once, then starts replicas ready at once."""
        setup = self.fleet.nodes
        assert setup is not None
        planner = PlannerState()
        for _ in range(2):  # the first round buys the nodes, the second starts the replicas on them
            inputs = PlannerInputs(self.snapshot(), {self.fleet.model: desired}, tuple(n.as_node() for n in self.nodes.values()),
                                   self.listing().replicas, setup.offerings, settings=setup.settings, id_prefix="sim")
            planner, actions = plan_nodes(inputs, planner, 0.0)
            for action in actions:
                if isinstance(action, CreateNode):
                    self.create_node(0.0, action, warm=True)
                elif isinstance(action, StartReplica):
                    self.start_on_node(0.0, action, warm=True)
        self.loop = LoopState(planner=planner)
        self.settle(0.0)

    def snapshot(self) -> Snapshot:
        setup = self.fleet.nodes
        assert setup is not None
        return setup.snapshot

    def decide(self, now: float) -> tuple[int, ModelObservation, bool]:
        """One tick of the live decision over the sim's fleet, its actions performed; returns the count, the
        observation and whether it panicked."""
        setup = self.fleet.nodes
        assert setup is not None
        inputs = TickInputs(setup.snapshot, self.listing(), {self.fleet.model: self.totals(now)}, setup.offerings,
                            now, now, tuple(self.outcomes))
        self.outcomes = []
        tick = decide(setup.decide_spec(PolicyStep(self.policy, self.fleet.min_replicas, self.fleet.max_replicas)),
                      self.loop, inputs)
        self.loop = tick.state
        for replica_id in tick.state.draining:
            replica = self.by_handle.get(replica_id)
            if replica is not None and not replica.draining:
                replica.draining = True  # routers see DRAINING at once (a poll's delay is left out)
                self.ready = None
        for action in tick.actions:
            self.perform(now, action)
        self.settle(now)
        decision = tick.decisions[self.fleet.model]
        return decision.desired, tick.observations[self.fleet.model], decision.panic

    def perform(self, now: float, action: object) -> None:
        """One action of the decision, as a provider and the loop's shell would perform it (`nodes.py`)."""
        if isinstance(action, CreateNode):
            self.create_node(now, action, warm=False)
        elif isinstance(action, DeleteNode):
            node = self.nodes.get(action.node_id)
            if node is not None:
                self.release_node(now, node)
        elif isinstance(action, StartReplica):
            self.start_on_node(now, action, warm=False)
        elif isinstance(action, BeginStop):
            replica = self.by_handle.get(action.replica_id)
            if replica is None:
                self.outcomes.append(StopEnded(action.replica_id))
                return
            replica.stop_by = now + self.fleet.nodes.drain_timeout_s  # type: ignore[union-attr]
            if replica.in_flight:
                self.push(replica.stop_by, _STOP_DEADLINE, replica.id)
            else:
                self.end_stop(now, replica)
        elif isinstance(action, CleanUp):
            replica = self.by_handle.get(action.replica_id)
            if replica is not None:
                self.release(now, replica)
        # Retire and Unpublish are membership records: routers here see a replica's state at once.

    def end_stop(self, now: float, replica: _Replica) -> None:
        """A stopped replica is gone: idle, or at its drain timeout (then what it still holds is cut off)."""
        self.outcomes.append(StopEnded(replica.handle))
        self.evict(now, replica)

    def create_node(self, now: float, action: CreateNode, warm: bool) -> None:
        setup = self.fleet.nodes
        assert setup is not None
        key = action.claim.offering
        prefix = f"{key.pool}/{key.instance_type}/{key.capacity_type.value}"
        if any(s.start_s <= now < s.end_s and prefix.startswith(s.key_prefix) for s in self.scenario.stockouts):
            # What the reconciler reports when `create` raises InsufficientCapacity.
            self.outcomes.append(CreateRefused(action.claim.model or "", action.boots_replica, now, now, key))
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

    def listing(self) -> Fleet:
        """The sim's nodes and replicas as the reconciler lists them (no claim is ever unlisted here: a node
        is listed, PENDING, from the moment it is bought)."""
        states = {"starting": ReplicaState.STARTING, "ready": ReplicaState.READY, "failed": ReplicaState.FAILED}
        replicas = tuple(ReplicaHandle(r.handle, self.fleet.model, r.node.id, "", None, states[r.state], r.started_at)
                         for r in self.replicas.values() if r.node is not None)
        return Fleet(tuple(n.as_node() for n in self.nodes.values()), replicas, {})

    # ---------------------------------------------------------------------------------- observation

    def totals(self, now: float) -> GatewayTotals:
        """What the gateway reports: its queue, requests at replicas, and the last 10 s of arrivals (or the
        time elapsed when less, as a gateway that just started does)."""
        second = int(now)
        span = max(1, min(_RATE_WINDOW_S, second))
        window = self.arrivals_per_second[second - span:second] if second else []
        prompts = self.prompt_tokens_per_second[second - span:second] if second else []
        squares = self.prompt_squares_per_second[second - span:second] if second else []
        completions = self.completions_per_second[second - span:second] if second else []
        mean = sum(window) / span
        return GatewayTotals(
            model=self.fleet.model, queued=len(self.queue), in_flight=sum(len(r.in_flight) for r in self.replicas.values()),
            arrivals_per_s=mean, ttft_p99_s=None, num_gateways=1, prompt_tokens_per_s=sum(prompts) / span,
            prompt_tokens_sq_per_s=sum(squares) / span,
            arrivals_var=sum((n - mean) ** 2 for n in window) / span if window else None,
            completions_per_s=sum(completions) / span)

    def observe(self, now: float) -> ModelObservation:
        """Without nodes: the observation the policy reads (with nodes, `decide` builds it from `totals`)."""
        t = self.totals(now)
        live = [r for r in self.replicas.values() if not r.draining]
        return ModelObservation(
            model=self.fleet.model, queued_at_gateways=t.queued, waiting=0, running=t.in_flight,
            arrivals_per_s=t.arrivals_per_s, ttft_p99_s=None,
            ready_replicas=sum(1 for r in live if r.state == "ready"),
            starting_replicas=sum(1 for r in live if r.state == "starting"),
            prompt_tokens_per_s=t.prompt_tokens_per_s, prompt_tokens_sq_per_s=t.prompt_tokens_sq_per_s,
            arrivals_var=t.arrivals_var, completions_per_s=t.completions_per_s)


def simulate(trace: Trace, fleet: FleetSetup, policy: Policy, scenario: Scenario = Scenario(), *,
             score_from_s: float = 0.0) -> RunResult:
    """Replay `trace` against a fleet sized by `policy`; deterministic for a given scenario seed.

    Everything before `score_from_s` is warm-up (see the module docstring).
    """
    return _Run(trace, fleet, policy, scenario, score_from_s).run()
