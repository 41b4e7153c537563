"""The simulator's node layer: the live loop's decision (`autoscaler.decide.decide`) on simulated nodes.

With a `NodePlanning` in its `FleetSetup`, the engine (`engine.py`) does not place replicas itself: each tick
it lists the sim's nodes and replicas as a provider lists them (`providers.base` `Node` and `ReplicaHandle`),
hands them with the gateway's totals, the registry's pools as `Offering`s and what became of the last tick's
actions to `decide`, with the policy as its replica step, and performs the actions it returns as the live
loop's shell and the providers would:
- `CreateNode` buys a node that is RUNNING `node_boot_s` later; an offering stocked out at that moment
  (`Scenario.stockouts`) comes back as a `CreateRefused` outcome, as the reconciler reports
  `InsufficientCapacity`: the planner skips it for its 180 s ICE TTL and the next claim goes to the next
  cheapest offering;
- `StartReplica` starts a replica on a running node, ready `model_load_s` later (or FAILED then, at
  `Scenario.start_failure_rate`: the decision backs the model's starts off and `CleanUp` removes it);
- a replica the planner stops drains: routers send it nothing new from that tick, `BeginStop` comes
  `drain_notice_s` later and it is gone once idle, or at `drain_timeout_s` with what it still holds cut off
  (requests without a first token go back to the queue); a `StopEnded` outcome reports it;
- `DeleteNode` releases a node and whatever still runs on it (empty, preempted or consolidated nodes); the
  decision holds it while a replica on it drains;
- a spot interruption marks the whole node INTERRUPTED: its replicas are gone at once and the planner
  deletes and replaces the node on its next tick.
GPU time and dollars are charged per node (all its GPUs, from purchase to release), not per replica.
The snapshot holds the simulated model alone: the decision scales every model it lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType

from kvgate.autoscaler.decide import DecideSpec, ReplicaStep
from kvgate.autoscaler.planner import PlannerSettings
from kvgate.autoscaler.settings import AutoscalerSettings
from kvgate.providers.base import Node, NodeClaim, NodeState, Offering, node_tags, offerings_from_pool
from kvgate.registry.snapshot import Snapshot

CLUSTER = "kvgate-sim"


@dataclass(frozen=True)
class NodePlanning:
    """What the planner needs from the registry: the snapshot, every pool's offerings, boot times."""

    snapshot: Snapshot
    offerings: tuple[Offering, ...]
    node_boot_s: dict[str, float]  # pool -> seconds from purchase to RUNNING
    model_load_s: float  # seconds from StartReplica to ready
    settings: PlannerSettings = PlannerSettings()
    loop: AutoscalerSettings = AutoscalerSettings()  # drain notice and timeout, start back-off: the live defaults

    @property
    def drain_timeout_s(self) -> float:
        return self.loop.drain_timeout_s

    def decide_spec(self, replicas: ReplicaStep) -> DecideSpec:
        """The live decision's spec with these settings and `replicas` as its replica step."""
        return DecideSpec(drain_notice_s=self.loop.drain_notice_s, backoff_base_s=self.loop.backoff_base_s,
                          backoff_max_s=self.loop.backoff_max_s, planner=self.settings, id_prefix="sim",
                          replicas=replicas)


def node_planning(snapshot: Snapshot, model_name: str, settings: PlannerSettings = PlannerSettings()) -> NodePlanning:
    """The planner's view of the registry for simulating `model_name`: the model alone (the decision would scale
    every model listed), all pools (the planner filters)."""
    offerings: list[Offering] = []
    for name, pool in sorted(snapshot.pools.items()):
        offerings.extend(offerings_from_pool(name, pool.spec))
    alone = replace(snapshot, models=MappingProxyType({model_name: snapshot.model(model_name)}))
    return NodePlanning(alone, tuple(offerings), {name: pool.spec.node_boot_s for name, pool in snapshot.pools.items()},
                       snapshot.model(model_name).spec.performance.model_load_s, settings)


@dataclass
class SimNode:
    """One bought node in the simulation. `serial` names it in the event heap (which holds ints)."""

    serial: int
    claim: NodeClaim
    offering: Offering
    launched_at: float
    state: NodeState = NodeState.PENDING
    replicas: set[int] = field(default_factory=set)  # engine replica ids on it (any state)

    @property
    def id(self) -> str:
        return f"node-{self.claim.id}"

    def as_node(self) -> Node:
        """The node as a provider would list it."""
        reason = "spot interruption" if self.state is NodeState.INTERRUPTED else ""
        return Node(self.id, self.claim.id, self.offering.pool, self.offering.instance_type,
                    self.offering.capacity_type, self.offering.zone, self.state, None,
                    node_tags(CLUSTER, self.claim), self.launched_at, self.offering.price_usd_per_hour, reason)
