"""The shared decision (`autoscaler.decide.decide`) on a fake clock, through a burst, a flash crowd, scale to zero,
a drain and failed starts, with the numbers worked in the comments.

`decide` is pure, so each test drives it tick by tick against `World`, a few lines standing in for the
providers (a node is RUNNING `node_boot_s` after it is bought, a replica READY `model_load_s` after it starts)
and for the loop's shell (stops end at once unless a test holds them). The live loop (`test_loop*.py`) and the
simulator (`test_sim_*.py`) run this same function.

Registry (`fleet_helpers.write_registry`): model m, target 4 ongoing requests per replica, 0..4 replicas,
stable window 20 s, panic window 6 s (threshold 2x), no scale-down delay, scale to zero after 30 s idle,
model load 5 s; pool gpu sells one-L4 nodes (on-demand $0.80/h) that boot in 30 s. Planner: empty nodes go
after 30 s (the planner's 120 s grace, cut to the pool's boot). Loop: drain notice 2 s, start back-off 5 s doubling.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from kvgate.autoscaler.decide import (BeginStop, CleanUp, DecideSpec, LoopState, Outcome, Retire, StopEnded, Tick,
                                      TickInputs, Unpublish, decide)
from kvgate.autoscaler.observe import GatewayTotals
from kvgate.autoscaler.planner import CreateNode, DeleteNode, StartReplica
from kvgate.autoscaler.reconciler import Fleet
from kvgate.autoscaler.status import EventKind
from kvgate.providers.base import Node, NodeState, ReplicaHandle, ReplicaState, node_tags, offerings_from_pool
from tests.autoscaler.fleet_helpers import CLUSTER, load_test_registry

BOOT_S, LOAD_S = 30.0, 5.0


@dataclass
class World:
    """What the providers list, moved on by the actions performed and by time; stops end at once unless `hold`."""

    nodes: dict[str, Node] = field(default_factory=dict)
    replicas: dict[str, ReplicaHandle] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    hold: set[str] = field(default_factory=set)  # replicas whose stop has not ended yet
    fail_starts: bool = False  # replicas fail at the end of their load

    def listing(self, now: float) -> Fleet:
        for node in list(self.nodes.values()):
            if node.state is NodeState.PENDING and now >= node.launched_at + BOOT_S:
                self.nodes[node.id] = replace(node, state=NodeState.RUNNING)
        for replica in list(self.replicas.values()):
            if replica.state is ReplicaState.STARTING and now >= replica.started_at + LOAD_S:
                state = ReplicaState.FAILED if self.fail_starts else ReplicaState.READY
                self.replicas[replica.id] = replace(replica, state=state, reason="out of memory" if self.fail_starts else "")
        return Fleet(tuple(self.nodes.values()), tuple(self.replicas.values()), {})

    def perform(self, tick: Tick, now: float) -> None:
        for action in tick.actions:
            if isinstance(action, CreateNode):
                claim = action.claim
                node_id = f"node-{claim.id}"
                self.nodes[node_id] = Node(node_id, claim.id, claim.pool, claim.offering.instance_type,
                                           claim.offering.capacity_type, claim.offering.zone, NodeState.PENDING, None,
                                           node_tags(CLUSTER, claim), now, action.price_usd_per_hour)
            elif isinstance(action, StartReplica):
                self.replicas[action.replica_id] = ReplicaHandle(action.replica_id, action.model, action.node_id, "",
                                                                 None, ReplicaState.STARTING, now)
            elif isinstance(action, BeginStop) and action.replica_id not in self.hold:
                self.end_stop(action.replica_id)
            elif isinstance(action, CleanUp):
                del self.replicas[action.replica_id]
            elif isinstance(action, DeleteNode):
                del self.nodes[action.node_id]
                self.replicas = {k: r for k, r in self.replicas.items() if r.node_id != action.node_id}

    def end_stop(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self.outcomes.append(StopEnded(replica_id))

    def take_outcomes(self) -> tuple[Outcome, ...]:
        outcomes, self.outcomes = tuple(self.outcomes), []
        return outcomes


@dataclass
class Run:
    """Ticks of `decide` once a second against a `World`, keeping what each tick did."""

    snapshot: object
    world: World = field(default_factory=World)
    state: LoopState = field(default_factory=LoopState)
    spec: DecideSpec = DecideSpec(id_prefix="t")
    ticks: dict[float, Tick] = field(default_factory=dict)

    def tick(self, now: float, *, queued: int = 0, in_flight: int = 0, rps: float = 0.0) -> Tick:
        totals = {"m": GatewayTotals("m", queued, in_flight, rps, None, 1)}
        offerings = tuple(offerings_from_pool("gpu", self.snapshot.pools["gpu"].spec))
        inputs = TickInputs(self.snapshot, self.world.listing(now), totals, offerings, now, now,
                            self.world.take_outcomes())
        tick = decide(self.spec, self.state, inputs)
        self.state = tick.state
        self.world.perform(tick, now)
        self.ticks[now] = tick
        return tick

    def when(self, kind: type) -> list[float]:
        """The ticks at which an action of `kind` was issued."""
        return [t for t, tick in self.ticks.items() if any(isinstance(a, kind) for a in tick.actions)]

    def desired(self, now: float) -> int:
        return self.ticks[now].decisions["m"].desired


def test_from_zero_to_a_request_and_back_to_zero(tmp_path: Path) -> None:
    run = Run(load_test_registry(tmp_path, node_boot_s=BOOT_S))
    for t in range(0, 10):
        assert run.tick(t).actions == ()  # nothing asked, nothing bought
    # t=10: one request held at the gateway. Scale from zero is immediate (no window): 1 replica, and the planner
    # buys one on-demand L4 node for it at once.
    tick = run.tick(10, queued=1)
    assert run.desired(10) == 1 and [a.price_usd_per_hour for a in tick.actions if isinstance(a, CreateNode)] == [0.80]
    # The node boots 30 s (RUNNING at 40): the replica starts there at the tick of 40 and is ready at 45. While the node
    # boots, its planned replica counts as starting, so nothing is bought twice. (At 40 itself the node runs and its
    # replica is not started yet: the observation, made first, counts neither; the count holds at 1 all the same.)
    for t in range(11, 46):
        tick = run.tick(t, queued=1)
        assert run.desired(t) == 1
        assert t == 40 or tick.actions == (), (t, tick.actions)
        assert tick.observations["m"].starting_replicas == (0 if t in (40, 45) else 1)
    assert run.when(StartReplica) == [40] and run.when(CreateNode) == [10]
    # It serves the request from 45 to 60, then all is idle: scale to zero 30 s after the last busy tick (60):
    # at 90 the count goes to 0 and the replica drains (routers see DRAINING); the stop begins 2 s later (92), ends
    # at once (nothing in flight) and comes back at the next tick (93): the membership record goes.
    for t in range(46, 61):
        run.tick(t, in_flight=1)
    for t in range(61, 94):
        run.tick(t)
    assert run.desired(89) == 1 and run.desired(90) == 0
    assert any(e.kind is EventKind.REPLICA_DRAIN for e in run.ticks[90].events)
    assert run.when(BeginStop) == [92] and run.when(Unpublish) == [93]
    # The node's empty-node grace counts from the drain (90); it is the planner's 120 s, cut to the pool's 30 s boot
    # (keeping an empty node longer than a new one takes to boot costs more than buying again): released at 120.
    for t in range(94, 215):
        run.tick(t)
    assert run.when(DeleteNode) == [120] and run.world.nodes == {}


def test_a_burst_panics_up_at_once_and_never_down_while_it_lasts(tmp_path: Path) -> None:
    # One replica serving 4 (its target) for a minute, then 16 at once. The panic window (6 s) averages the
    # ongoing requests: at t=60 (5 samples of 4, one of 16) it is 6, 2 replicas' worth: 2 / 1 ready >= 2, panic,
    # 2 wanted. It grows by 2 a tick: 8 -> 2, 10 -> 3, 12 -> 3, 14 -> 4, and stays at 4 (the most) with 16.
    run = Run(load_test_registry(tmp_path, min_replicas=1, node_boot_s=BOOT_S))
    for t in range(0, 60):
        run.tick(t, in_flight=4 if t >= 40 else 0)
    assert run.desired(59) == 1 and len(run.world.replicas) == 1
    for t in range(60, 66):
        run.tick(t, in_flight=16)
    assert [run.desired(t) for t in range(60, 66)] == [2, 2, 3, 3, 4, 4]
    assert all(run.ticks[t].decisions["m"].panic for t in range(60, 66))
    # Each rise buys nodes at once for the new replicas only (1 + 1 + 1 = 3 more nodes, never twice).
    assert [sum(isinstance(a, CreateNode) for a in run.ticks[t].actions) for t in range(60, 66)] == [1, 0, 1, 0, 1, 0]
    # The burst halves after 30 s: in panic the count never drops, though half the load needs 2.
    for t in range(66, 96):
        run.tick(t, in_flight=16 if t < 80 else 8)
    assert {run.desired(t) for t in range(66, 96)} == {4}


def test_a_flash_crowd_on_an_empty_fleet_buys_its_size_in_two_ticks(tmp_path: Path) -> None:
    # Idle and at zero for a minute, then 40 requests at once, held at the gateway (queued). Nothing is ready, so
    # every busy tick panics on the panic window's mean (6 s of samples): 40 / 6 = 6.7 at 60 -> 2 replicas,
    # 80 / 6 = 13.3 at 61 -> 4, and on to 40 -> 10, held to max_replicas 4. The planner buys a node for each new
    # replica in the tick it is first wanted (2 at 60, 2 at 61), nothing more while they boot (30 s), and starts
    # each replica in the tick its node runs.
    run = Run(load_test_registry(tmp_path, node_boot_s=BOOT_S))
    for t in range(0, 60):
        run.tick(t)
    for t in range(60, 120):
        run.tick(t, queued=40 if t < 100 else 0, in_flight=0 if t < 100 else 16)
    assert [run.desired(t) for t in range(60, 66)] == [2, 4, 4, 4, 4, 4]
    assert "-> 10" in run.ticks[65].decisions["m"].reason and "clamped to [0, 4]" in run.ticks[65].decisions["m"].reason

    def count(kind: type) -> dict[float, int]:
        return {t: n for t in run.ticks if (n := sum(isinstance(a, kind) for a in run.ticks[t].actions))}
    assert count(CreateNode) == {60: 2, 61: 2}
    assert count(StartReplica) == {90: 2, 91: 2}
    assert all(tick.decisions["m"].panic for t, tick in run.ticks.items() if 60 <= t < 100)


def test_a_drain_holds_the_stop_until_the_notice_and_the_node_until_the_stop_ends(tmp_path: Path) -> None:
    # Two replicas (min 1) serving 8, their target; at 80 the load goes. The stable window (20 s) averages 4 by 89:
    # 1 replica. The one going drains: its stop begins 2 s later (91) and, held here (requests in flight), ends only
    # when the world says so. Its node's empty-node grace (30 s) runs from the drain, but the node is not deleted
    # while the replica drains on it (at 119 the grace is over); it goes at the first tick after the stop ends.
    run = Run(load_test_registry(tmp_path, min_replicas=1, node_boot_s=BOOT_S))
    for t in range(0, 80):
        run.tick(t, in_flight=8)
    assert len(run.world.replicas) == 2
    run.world.hold = set(run.world.replicas)
    for t in range(80, 400):
        run.tick(t)
    assert run.desired(88) == 2 and run.desired(89) == 1
    assert run.when(BeginStop) == [91]
    assert run.when(DeleteNode) == [] and len(run.world.nodes) == 2  # the stop has not ended: the node stays
    run.world.end_stop(next(iter(run.state.draining)))
    for t in range(400, 402):
        run.tick(t)
    assert run.when(Unpublish) == [400] and run.when(DeleteNode) == [400]
    assert len(run.world.nodes) == 1 and run.state.draining == {}


def test_failed_starts_back_off_5_10_20_s_and_are_cleaned_up(tmp_path: Path) -> None:
    # min 1 replica whose engine dies at the end of every load (5 s). Each failure: one last DRAINING record
    # (Retire), the provider told to stop it (CleanUp), and the next start held for 5, 10, then 20 s.
    run = Run(load_test_registry(tmp_path, min_replicas=1, node_boot_s=BOOT_S))
    run.world.fail_starts = True
    for t in range(0, 120):
        run.tick(t)
    failed = run.when(CleanUp)
    starts = run.when(StartReplica)
    assert run.when(Retire) == failed
    # The node is bought at 0 and runs at 30: starts at 30, fails at 35 (back-off 5 s: the next start at 40),
    # fails at 45 (10 s: 55), fails at 60 (20 s: 80), fails at 85 (40 s: 125).
    assert starts == [30, 40, 55, 80] and failed == [35, 45, 60, 85]
    assert "next start in 40s" in next(e.message for e in run.ticks[85].events if e.kind is EventKind.REPLICA_FAILED)
