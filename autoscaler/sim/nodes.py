"""The simulator's node layer: the live node planner (`autoscaler.planner.plan_nodes`) on simulated nodes.

With a `NodePlanning` in its `FleetSetup`, the engine (`engine.py`) does not place replicas itself: each
tick it hands the planner the sim's nodes and replicas as the planner's input types (`providers.base`
`Node` and `ReplicaHandle`), the registry's pools as `Offering`s, and the policy's desired count, and
performs the actions the planner returns, as the live loop's reconciler would:
- `CreateNode` buys a node that is RUNNING `node_boot_s` later; an offering stocked out at that moment
  (`Scenario.stockouts`) raises nothing but is noted with `note_insufficient_capacity` (the planner's
  180 s ICE cache), exactly what the reconciler does on `InsufficientCapacity`; the next tick's claim
  goes to the next cheapest offering;
- `StartReplica` starts a replica on a running node, ready `model_load_s` later;
- `StopReplica` drains a replica (cancels it when still starting);
- `DeleteNode` releases a node and whatever still runs on it (empty, preempted or consolidated nodes);
- a spot interruption marks the whole node INTERRUPTED: its replicas are gone at once and the planner
  deletes and replaces the node on its next tick.
GPU time and dollars are charged per node (all its GPUs, from purchase to release), not per replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.autoscaler.planner import LABEL_PLANNED_REPLICAS, PlannerSettings
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


def node_planning(snapshot: Snapshot, model_name: str, settings: PlannerSettings = PlannerSettings()) -> NodePlanning:
    """The planner's view of the registry for simulating `model_name` (all pools: the planner filters)."""
    offerings: list[Offering] = []
    for name, pool in sorted(snapshot.pools.items()):
        offerings.extend(offerings_from_pool(name, pool.spec))
    return NodePlanning(snapshot, tuple(offerings), {name: pool.spec.node_boot_s for name, pool in snapshot.pools.items()},
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

    @property
    def planned_replicas(self) -> int:
        return int(self.claim.labels.get(LABEL_PLANNED_REPLICAS, "1"))

    def as_node(self) -> Node:
        """The node as a provider would list it."""
        reason = "spot interruption" if self.state is NodeState.INTERRUPTED else ""
        return Node(self.id, self.claim.id, self.offering.pool, self.offering.instance_type,
                    self.offering.capacity_type, self.offering.zone, self.state, None,
                    node_tags(CLUSTER, self.claim), self.launched_at, self.offering.price_usd_per_hour, reason)
