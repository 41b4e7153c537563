"""The node planner: which nodes to buy and release, and where replicas run (level 2, minutes).

One pure function, `plan_nodes(inputs, state, now)`, called once per tick by the reconciler (live) and
by the simulator. It turns "model M should have N replicas" (the scaler's answers) plus "these nodes,
claims, replicas and offerings exist" into actions for the reconciler to perform.

The rules, and where they come from:
- Replicas first go on free room of running nodes (cheapest room first); replicas that fit nowhere
  become node claims. Each claim gets the offering with the lowest price per replica it will hold,
  among the compatible (GPU kind, count, memory), available offerings of the pools the model may use,
  within each pool's max_nodes, max_gpus and budget_usd_per_hour (Karpenter's cheapest compatible
  offering).
- Spot where placement.allow_spot, keeping placement.on_demand_base_replicas on on-demand (SkyServe).
- An offering that failed with insufficient capacity, or whose spot node was interrupted, is skipped
  for `ice_ttl_s` (180 s, Karpenter's ICE cache); the next tick's claim goes to the next cheapest
  (another zone, region or cloud) and comes back after the TTL.
- Interrupted (preempted) nodes are deleted; their replicas stop counting, so the deficit is re-placed
  in the same tick.
- A running node with no replica for `empty_node_grace_s` is released.
- Consolidation (Karpenter): when nothing is pending, a node whose replicas fit elsewhere (free room, or
  a cheaper new node) for at least `consolidation_min_saving` of its price is disrupted, at most
  `disruption_budget_nodes` at a time: the replacements start first; its replicas stop and the node is
  deleted only once the replacements are ready.

`now` is wall-clock seconds (the timeline of `Node.launched_at`); the simulator passes its fake wall time.
Pure: no clock reads, no I/O, no randomness. Claim and replica ids come from a counter in the state and
`inputs.id_prefix`, which the caller makes unique per autoscaler incarnation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Union

from providers.base import NodeClaim, Node, Offering, OfferingKey, ReplicaHandle
from registry.snapshot import Snapshot

# The claim label that says how many replicas of `claim.model` the node was bought for, so a
# restarted planner (which lost its memory) still knows the node's room is spoken for.
LABEL_PLANNED_REPLICAS = "kvgate:planned-replicas"


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """Knobs of the node planner; the defaults follow Karpenter where it has one."""

    ice_ttl_s: float = 180.0  # Karpenter's insufficient-capacity cache: 3 minutes
    empty_node_grace_s: float = 120.0  # a running node with no replica is released after this
    consolidation_enabled: bool = True
    consolidation_min_saving: float = 0.2  # replace only when it saves >= 20 % of the node's price
    consolidation_min_age_s: float = 600.0  # leave nodes younger than this alone (they were just bought)
    disruption_budget_nodes: int = 1  # nodes being consolidated at once
    disruption_timeout_s: float = 900.0  # give up a consolidation whose replacements never became ready
    cpu_replicas_per_node: int = 4  # replicas of a CPU-only model (gpu_count 0) one CPU node holds


@dataclass(frozen=True, slots=True)
class PlannerInputs:
    """Everything one planning tick looks at.

    `claims` are claims the reconciler holds whose node is not in `nodes` yet (written, provider maybe
    called): they count as capacity being bought, so a claim is never bought twice. `nodes` and
    `replicas` are what the providers list (all pools together). `offerings` are all offerings of all
    pools, sold-out ones flagged. `desired` maps model name -> replicas (models missing: 0 wanted
    for models with autoscaled replicas present; models unknown to the snapshot are reported).
    """

    snapshot: Snapshot
    desired: Mapping[str, int]
    nodes: tuple[Node, ...]
    replicas: tuple[ReplicaHandle, ...]
    offerings: tuple[Offering, ...]
    claims: tuple[NodeClaim, ...] = ()
    settings: PlannerSettings = PlannerSettings()
    id_prefix: str = "kvg"  # claim ids are f"{id_prefix}-n{seq}", replica ids f"{id_prefix}-r{seq}"


@dataclass(frozen=True, slots=True)
class Disruption:
    """A node being consolidated away: its replacements were started at `started_at`."""

    node_id: str
    started_at: float
    reason: str


@dataclass(frozen=True, slots=True)
class PlannerState:
    """What the planner remembers between ticks. Start with `PlannerState()`.

    Losing it (a restart) is safe: sold-out offerings are retried (and fail again, cheaply), empty
    nodes wait one more grace period, consolidations in flight are re-judged from scratch.
    """

    unavailable_until: Mapping[OfferingKey, float] = field(default_factory=dict)  # ICE cache
    empty_since: Mapping[str, float] = field(default_factory=dict)  # node id -> first seen empty
    disruptions: tuple[Disruption, ...] = ()
    next_seq: int = 1


# ---------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class CreateNode:
    """Buy one node. The reconciler writes `claim` to the state store before calling the provider."""

    claim: NodeClaim
    price_usd_per_hour: float
    reason: str


@dataclass(frozen=True, slots=True)
class DeleteNode:
    """Release one node (and every replica on it). `reason`: "empty", "preempted", "consolidated"."""

    node_id: str
    pool: str
    reason: str


@dataclass(frozen=True, slots=True)
class StartReplica:
    """Start one replica of `model` on a running node, with the id the planner chose (idempotent)."""

    model: str
    node_id: str
    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class StopReplica:
    """Stop one replica (drain first). `reason`: "scale down", "failed", "consolidated"."""

    replica_id: str
    model: str
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """Not an action on anything: `replicas` of `model` fit nowhere now, and why (for the event log)."""

    model: str
    replicas: int
    reason: str


NodeAction = Union[CreateNode, DeleteNode, StartReplica, StopReplica, Unschedulable]


def note_insufficient_capacity(state: PlannerState, offering: OfferingKey, now: float,
                               ttl_s: float = 180.0) -> PlannerState:
    """Remember that `offering` failed with insufficient capacity at `now`: skip it until now + ttl_s.

    The reconciler calls this when `create` raises `InsufficientCapacity`; the planner itself calls it
    for the offering of a node that was interrupted. Noting an offering again extends the skip.
    """
    until = dict(state.unavailable_until)
    until[offering] = max(until.get(offering, 0.0), now + ttl_s)
    return replace(state, unavailable_until=until)


def plan_nodes(inputs: PlannerInputs, state: PlannerState,
               now: float) -> tuple[PlannerState, list[NodeAction]]:
    """One planning tick: the new state and the actions, in the order to perform them.

    Contract: never returns a CreateNode for capacity already covered by a listed node or an input
    claim; never stops the last replicas of a model before their replacements are ready during
    consolidation; every action names ids present in `inputs` (or minted in this call).
    """
    raise NotImplementedError("landing next: signatures first so the reconciler and simulator can code against them")
