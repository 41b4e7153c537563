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
- A running node with no replica for `empty_node_grace_s` is released, once nothing drains there; replicas
  draining (`PlannerInputs.leaving`) hold their GPUs until they stop, so their room is not offered.
- Consolidation (Karpenter): when nothing is pending, a node whose replicas fit elsewhere (free room, or
  a cheaper new node) for at least `consolidation_min_saving` of its price is disrupted, at most
  `disruption_budget_nodes` at a time: the replacements start first; its replicas stop once the
  replacements are ready, and the node is deleted once they have drained. An empty node is no room for
  a consolidation (it goes anyway).

`now` is wall-clock seconds (the timeline of `Node.launched_at`); the simulator passes its fake wall time.
Pure: no clock reads, no I/O, no randomness. Claim and replica ids come from a counter in the state and
`inputs.id_prefix`, which the caller makes unique per autoscaler incarnation.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Union

from kvgate.autoscaler.offers import PoolUsage, cheapest, compatible, node_units, units_per_replica
from kvgate.providers.base import (TAG_REPLICA, CapacityType, Node, NodeClaim, NodeState, Offering, OfferingKey,
                                   ReplicaHandle, ReplicaState, replica_spec_for)
from kvgate.registry.schema import ModelDoc
from kvgate.registry.snapshot import Snapshot

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
    id_prefix: str = "kvg"
    # Replicas draining on listed nodes (the loop's drains): they hold their GPUs until they stop, so their room is
    # not free and their node is not deleted yet, but they count for no model and are never stopped again.
    leaving: tuple[ReplicaHandle, ...] = ()  # claim ids are f"{id_prefix}-n{seq}", replica ids f"{id_prefix}-r{seq}"


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
    # The node boots straight into the claim's replica (Offering.replica_at_boot): buying it is starting a
    # replica, so the loop holds it back while the model's starts are backed off after failures.
    boots_replica: bool = False


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


# ------------------------------------------------------------------------------------------ the tick


@dataclass(slots=True)
class _Host:
    """A node (or a claim not yet a node) as one tick sees it. Mutable scratch; never leaves the call."""

    id: str  # node id, or "claim:<id>" for a claim with no node listed yet
    pool: str
    offering: Offering | None  # None: its offering is no longer listed (no room is offered on it)
    capacity_type: CapacityType
    price_usd_per_hour: float
    running: bool  # replicas may start on it now
    launched_at: float | None
    units: int
    replicas: list[ReplicaHandle] = field(default_factory=list)
    planned_model: str | None = None
    planned_n: int = 0
    disrupting: bool = False
    used: int = 0  # units taken by live and leaving replicas, this tick's starts, and (pending hosts) reservations
    leaving: int = 0  # replicas draining on it: it is not deleted before they are gone
    # A node that boots into its replica (Offering.replica_at_boot) whose one replica was handed out: adopted,
    # failed or being stopped. Its room is gone for good, whatever the replicas listed on it say (a stopped
    # or draining one is not in the planner's inputs, and stopping it ends the node).
    boot_used: bool = False

    def unfilled(self) -> int:
        have = sum(1 for r in self.replicas if r.model == self.planned_model)
        return max(0, self.planned_n - have)


@dataclass(slots=True)
class _Tick:
    """One call's working set: inputs indexed, the usage per pool, the actions so far."""

    inputs: PlannerInputs
    now: float
    unavailable: dict[OfferingKey, float]
    seq: int
    hosts: dict[str, _Host] = field(default_factory=dict)
    usage: dict[str, PoolUsage] = field(default_factory=dict)
    actions: list[NodeAction] = field(default_factory=list)
    stopped: set[str] = field(default_factory=set)  # replica ids stopped this tick

    def mint(self, kind: str) -> str:
        self.seq += 1
        return f"{self.inputs.id_prefix}-{kind}{self.seq - 1}"

    def model(self, name: str) -> ModelDoc | None:
        return self.inputs.snapshot.models.get(name)

    def live(self, host: _Host, model: str | None = None) -> list[ReplicaHandle]:
        return [r for r in host.replicas if r.id not in self.stopped and (model is None or r.model == model)]


def _find_offering(offerings: tuple[Offering, ...], pool: str, instance_type: str,
                   capacity_type: CapacityType, zone: str) -> Offering | None:
    # A node lands in a concrete zone even when its offering was "any zone" (zone "").
    exact = loose = None
    for o in offerings:
        if o.pool == pool and o.instance_type == instance_type and o.capacity_type is capacity_type:
            if o.zone == zone:
                exact = o
            elif o.zone == "" and loose is None:
                loose = o
    return exact or loose


def _index_hosts(tick: _Tick) -> None:
    """Hosts from listed nodes and node-less claims; interrupted nodes are deleted and ICE-noted."""
    inputs, cpu = tick.inputs, tick.inputs.settings.cpu_replicas_per_node
    listed_claims = {n.claim_id for n in inputs.nodes}
    for node in sorted(inputs.nodes, key=lambda n: n.id):
        offering = _find_offering(inputs.offerings, node.pool, node.instance_type, node.capacity_type, node.zone)
        if node.state is NodeState.INTERRUPTED:
            key = offering.key if offering else OfferingKey(node.pool, node.instance_type, node.capacity_type, node.zone)
            tick.unavailable[key] = max(tick.unavailable.get(key, 0.0), tick.now + inputs.settings.ice_ttl_s)
            tick.actions.append(DeleteNode(node.id, node.pool, f"preempted: {node.reason or 'spot interruption'}"))
            continue
        if node.state not in (NodeState.PENDING, NodeState.RUNNING):
            continue
        host = _Host(node.id, node.pool, offering, node.capacity_type, node.price_usd_per_hour,
                     node.state is NodeState.RUNNING, node.launched_at,
                     node_units(offering, cpu) if offering else 0,
                     planned_model=node.model, planned_n=planned_replicas(node.tags),
                     boot_used=node.tags.get(TAG_REPLICA, node.claim_id) != node.claim_id)
        tick.hosts[host.id] = host
    for claim in sorted(inputs.claims, key=lambda c: c.id):
        if claim.id in listed_claims:
            continue
        k = claim.offering
        offering = _find_offering(inputs.offerings, k.pool, k.instance_type, k.capacity_type, k.zone)
        host = _Host(f"claim:{claim.id}", k.pool, offering, k.capacity_type,
                     offering.price_usd_per_hour if offering else 0.0, False, None,
                     node_units(offering, cpu) if offering else 0,
                     planned_model=claim.model, planned_n=planned_replicas(claim.labels))
        tick.hosts[host.id] = host
    for host in tick.hosts.values():
        usage = tick.usage.setdefault(host.pool, PoolUsage())
        usage.num_nodes += 1
        usage.num_gpus += host.offering.gpu_count if host.offering else 0
        usage.usd_per_hour += host.price_usd_per_hour


def planned_replicas(tags: Mapping[str, str]) -> int:
    """The replicas a claim or node was bought for (its LABEL_PLANNED_REPLICAS; 1 when absent or unreadable)."""
    try:
        return max(0, int(tags.get(LABEL_PLANNED_REPLICAS, "1")))
    except ValueError:
        return 1


def _index_replicas(tick: _Tick) -> None:
    """Attach live replicas to their hosts; failed replicas are stopped (their model re-placed)."""
    for replica in sorted(tick.inputs.replicas, key=lambda r: r.id):
        host = tick.hosts.get(replica.node_id)
        if replica.state is ReplicaState.FAILED:
            if host is not None:
                host.boot_used = True  # stopping it ends a node that boots its replica: no room there
            tick.actions.append(StopReplica(replica.id, replica.model, replica.node_id,
                                            f"failed: {replica.reason or 'no reason given'}"))
            continue
        if replica.state in (ReplicaState.STARTING, ReplicaState.READY) and host is not None:
            host.replicas.append(replica)
    leaving_units: dict[str, int] = {}
    for replica in tick.inputs.leaving:
        host = tick.hosts.get(replica.node_id)
        if host is not None:
            host.leaving += 1
            leaving_units[host.id] = leaving_units.get(host.id, 0) + _units_of(tick, replica.model)
    for host in tick.hosts.values():
        model = tick.model(host.planned_model) if host.planned_model else None
        reserved = host.unfilled() * units_per_replica(model) if (model and not host.running) else 0
        host.used = reserved + sum(_units_of(tick, r.model) for r in host.replicas) + leaving_units.get(host.id, 0)


def _units_of(tick: _Tick, model_name: str) -> int:
    model = tick.model(model_name)
    return units_per_replica(model) if model else 1


def _supply(tick: _Tick, model: str) -> tuple[int, int]:
    """(replicas counted for `model`, of them on on-demand capacity): live replicas on hosts not being
    disrupted, plus unfilled reservations on hosts still booting."""
    total = on_demand = 0
    for host in tick.hosts.values():
        if host.disrupting:
            continue
        n = len(tick.live(host, model))
        if not host.running and host.planned_model == model:
            n += host.unfilled()
        total += n
        on_demand += n if host.capacity_type is CapacityType.ON_DEMAND else 0
    return total, on_demand


def _has_room(tick: _Tick, host: _Host, model: ModelDoc, need: int, on_demand_only: bool) -> bool:
    """Whether one more replica of `model` (taking `need` units) may start on `host` now.

    A node that boots into its claim's replica (`Offering.replica_at_boot`, AWS) has room only for that
    one replica of the model it was bought for, whatever its GPU count says."""
    offering = host.offering
    if not host.running or host.disrupting or offering is None:
        return False
    if offering.replica_at_boot and (host.planned_model != model.metadata.name or host.boot_used
                                     or host.replicas):
        return False
    return compatible(model, offering, on_demand_only=on_demand_only) and host.units - host.used >= need


def _place(tick: _Tick, model: ModelDoc, count: int, on_demand_only: bool, reason: str,
           exclude: Collection[str] = ()) -> tuple[list[NodeAction], int, str]:
    """Place `count` replicas: free room on running hosts first, then new nodes at the cheapest offering.

    Returns (actions, replicas left unplaced, why). Updates the tick's hosts and usage as it goes, so a
    caller that wants a dry run works on a copy (see `_consolidate`).
    """
    name, need = model.metadata.name, units_per_replica(model)
    actions: list[NodeAction] = []
    rooms = [h for h in tick.hosts.values()
             if h.id not in exclude and _has_room(tick, h, model, need, on_demand_only)]
    # Room reserved for this model first (it was bought for it), then the cheapest room per unit.
    rooms.sort(key=lambda h: (h.planned_model != name, h.price_usd_per_hour / max(1, h.units), h.id))
    for host in rooms:
        while count > 0 and _has_room(tick, host, model, need, on_demand_only):
            replica_id = tick.mint("r")
            actions.append(StartReplica(name, host.id, replica_id, reason))
            host.used += need
            host.replicas.append(ReplicaHandle(replica_id, name, host.id, "", None, ReplicaState.STARTING, tick.now))
            count -= 1
    while count > 0:
        choice = cheapest(model, count, tick.inputs.offerings, unavailable=tick.unavailable, now=tick.now,
                          usage=tick.usage, pools={k: v.spec for k, v in tick.inputs.snapshot.pools.items()},
                          on_demand_only=on_demand_only,
                          cpu_replicas_per_node=tick.inputs.settings.cpu_replicas_per_node)
        if choice.offering is None:
            return actions, count, choice.why_not
        offering = choice.offering
        # The replica spec rides on the claim: a node that boots straight into its replica (AWS) has no
        # other way to learn which engine to start.
        claim = NodeClaim(tick.mint("n"), offering.key, model=name,
                          replica=replica_spec_for(model, tick.inputs.snapshot.adapters_of(name)),
                          labels={LABEL_PLANNED_REPLICAS: str(choice.replicas)})
        actions.append(CreateNode(claim, offering.price_usd_per_hour,
                                  f"{reason}: {choice.replicas} replica(s) of {name} on {offering.key} "
                                  f"at ${offering.price_usd_per_hour:.2f}/h", boots_replica=offering.replica_at_boot))
        tick.usage.setdefault(offering.pool, PoolUsage()).add(offering)
        tick.hosts[f"claim:{claim.id}"] = _Host(
            f"claim:{claim.id}", offering.pool, offering, offering.capacity_type, offering.price_usd_per_hour,
            False, None, node_units(offering, tick.inputs.settings.cpu_replicas_per_node),
            planned_model=name, planned_n=choice.replicas, used=choice.replicas * need)
        count -= choice.replicas
    return actions, 0, ""


def _scale_models(tick: _Tick) -> None:
    """Per model: place the deficit (on-demand base first), stop the surplus."""
    desired = dict(tick.inputs.desired)
    names = sorted(set(desired) | {r.model for h in tick.hosts.values() for r in h.replicas})
    for name in names:
        model = tick.model(name)
        want = max(0, desired.get(name, 0))
        if model is None:
            # Removed from the registry (or never there): nothing may run for it.
            want = 0
        have, on_demand = _supply(tick, name)
        if have < want and model is not None:
            base = min(model.spec.placement.on_demand_base_replicas, want) if model.spec.placement.allow_spot else 0
            need_od = min(want - have, max(0, base - on_demand))
            left_total, why = 0, ""
            for count, od_only, label in ((need_od, True, "on-demand base"), (want - have - need_od, False, "scale up")):
                if count <= 0:
                    continue
                actions, left, why_part = _place(tick, model, count, od_only, f"{label} {have} -> {want}")
                tick.actions.extend(actions)
                left_total += left
                why = why or why_part
            if left_total:
                tick.actions.append(Unschedulable(name, left_total, why))
        elif have > want:
            _stop_surplus(tick, name, model, have - want, want)


def _stop_surplus(tick: _Tick, name: str, model: ModelDoc | None, surplus: int, want: int) -> None:
    """Stop `surplus` live replicas: not-yet-ready ones first, then those on the emptiest and priciest
    nodes (so whole nodes free up), never taking on-demand below the model's on-demand base."""
    base = min(model.spec.placement.on_demand_base_replicas, want) if model else 0
    _, on_demand = _supply(tick, name)
    candidates = [(h, r) for h in tick.hosts.values() if not h.disrupting for r in tick.live(h, name)]
    candidates.sort(key=lambda hr: (hr[1].state is ReplicaState.READY, len(tick.live(hr[0])),
                                    -hr[0].price_usd_per_hour / max(1, hr[0].units), hr[1].id))
    for host, replica in candidates:
        if surplus <= 0:
            break
        if host.capacity_type is CapacityType.ON_DEMAND:
            if on_demand - 1 < base:
                continue
            on_demand -= 1
        tick.stopped.add(replica.id)
        host.used -= _units_of(tick, name)
        host.boot_used = True
        tick.actions.append(StopReplica(replica.id, name, host.id, f"scale down to {want}"))
        surplus -= 1


def _finish_disruptions(tick: _Tick, disruptions: tuple[Disruption, ...]) -> tuple[Disruption, ...]:
    """Keep disruptions whose node still exists and that have not timed out; complete those whose
    replacements are ready: stop the old replicas, then delete the node."""
    kept: list[Disruption] = []
    for d in disruptions:
        host = tick.hosts.get(d.node_id)
        if host is None or tick.now - d.started_at > tick.inputs.settings.disruption_timeout_s:
            if host is not None:
                host.disrupting = False  # timed out: its replicas count again; the spares become surplus
            continue
        host.disrupting = True
        kept.append(d)
    return tuple(kept)


def _complete_disruptions(tick: _Tick, disruptions: tuple[Disruption, ...]) -> tuple[Disruption, ...]:
    """Once a disrupted node's models have their replicas ready elsewhere, stop its replicas; delete it once
    they are gone (they drain first: the disruption is kept until then)."""
    kept: list[Disruption] = []
    desired = tick.inputs.desired
    for d in disruptions:
        host = tick.hosts[d.node_id]
        models = {r.model for r in tick.live(host)}
        ready = {m: sum(1 for h in tick.hosts.values() if not h.disrupting for r in tick.live(h, m)
                        if r.state is ReplicaState.READY) for m in models}
        if not all(ready[m] >= desired.get(m, 0) for m in models):
            kept.append(d)
            continue
        for r in tick.live(host):
            tick.stopped.add(r.id)
            tick.actions.append(StopReplica(r.id, r.model, host.id, f"consolidated: {d.reason}"))
        if models or host.leaving:
            kept.append(d)  # its replicas drain now: deleted at the first tick they are all gone
            continue
        tick.actions.append(DeleteNode(host.id, host.pool, f"consolidated: {d.reason}"))
        if host.offering is not None:
            tick.usage[host.pool].remove(host.offering)
        del tick.hosts[host.id]
    return tuple(kept)


def _release_empty(tick: _Tick, empty_since: Mapping[str, float]) -> dict[str, float]:
    """Running nodes with no replica: note since when; delete those empty for the grace period. The grace counts
    from the last replica's stop (its drain included); the node goes once it is over and nothing drains there."""
    result: dict[str, float] = {}
    for host in sorted(tick.hosts.values(), key=lambda h: h.id):
        if not host.running or host.disrupting or tick.live(host):
            continue
        grace = _empty_grace_s(tick, host)
        since = empty_since.get(host.id, tick.now)
        draining = host.leaving or any(r.id in tick.stopped for r in host.replicas)  # stopped this tick: drain first
        if tick.now - since >= grace and not draining:
            tick.actions.append(DeleteNode(host.id, host.pool, f"empty for {tick.now - since:.0f}s >= {grace:g}s"))
            if host.offering is not None:
                tick.usage[host.pool].remove(host.offering)
            del tick.hosts[host.id]  # gone: consolidation later in this tick must not count it as room
        else:
            result[host.id] = since
    return result


def _empty_grace_s(tick: _Tick, host: _Host) -> float:
    """How long an empty node is kept for a replica that may come back: `empty_node_grace_s`, and never longer than
    its pool takes to boot a node. Keeping it longer costs more than buying it again (the rent-or-buy break-even;
    the simulator's node plan showed 120 s of grace on 20 s pods as most of the planner's excess). A pool that
    boots in no time (this machine) keeps the configured grace: there the grace is only hysteresis."""
    grace = tick.inputs.settings.empty_node_grace_s
    pool = tick.inputs.snapshot.pools.get(host.pool)
    boot_s = pool.spec.node_boot_s if pool is not None else 0.0
    return min(grace, boot_s) if boot_s > 0 else grace


def _consolidate(tick: _Tick, disruptions: tuple[Disruption, ...]) -> tuple[Disruption, ...]:
    """Start at most one consolidation, when the fleet is steady and the disruption budget allows."""
    s = tick.inputs.settings
    steady = not any(isinstance(a, (CreateNode, StartReplica, Unschedulable)) for a in tick.actions)
    if not (s.consolidation_enabled and steady and len(disruptions) < s.disruption_budget_nodes):
        return disruptions
    if any(not h.running for h in tick.hosts.values()):
        return disruptions  # something is still booting: judge the fleet once it has settled
    candidates = [h for h in tick.hosts.values()
                  if not h.disrupting and tick.live(h) and h.launched_at is not None
                  and tick.now - h.launched_at >= s.consolidation_min_age_s
                  and all(r.state is ReplicaState.READY for r in tick.live(h))]
    if any(r.state is not ReplicaState.READY for h in tick.hosts.values() for r in tick.live(h)):
        return disruptions
    candidates.sort(key=lambda h: (-h.price_usd_per_hour, len(tick.live(h)), h.id))
    for host_id in [h.id for h in candidates]:
        # A dry run: a candidate that does not pay leaves the tick exactly as it was.
        saved = _save(tick)
        host = tick.hosts[host_id]
        host.disrupting = True
        actions, ok = _replace_host(tick, host)
        new_cost = sum(a.price_usd_per_hour for a in actions if isinstance(a, CreateNode))
        if ok and new_cost <= host.price_usd_per_hour * (1.0 - s.consolidation_min_saving) + 1e-9:
            reason = (f"node {host.id} (${host.price_usd_per_hour:.2f}/h) -> "
                      f"{'free room elsewhere' if new_cost == 0 else f'${new_cost:.2f}/h'}")
            tick.actions.extend(_relabel(a, reason) for a in actions)
            return disruptions + (Disruption(host.id, tick.now, reason),)
        _restore(tick, saved)
    return disruptions


_Saved = tuple[dict[str, "_Host"], dict[str, tuple[int, list[ReplicaHandle], bool]], dict[str, PoolUsage], int]


def _save(tick: _Tick) -> _Saved:
    """What a placement dry run may change: hosts added, each host's room, replicas and disruption mark, pool
    usage and the id counter. A copy of just these: a deep copy of the hosts per candidate per tick was 85% of
    a simulated hour."""
    return (dict(tick.hosts), {h.id: (h.used, list(h.replicas), h.disrupting) for h in tick.hosts.values()},
            {pool: copy.copy(usage) for pool, usage in tick.usage.items()}, tick.seq)


def _restore(tick: _Tick, saved: _Saved) -> None:
    hosts, marks, usage, seq = saved
    for host_id, (used, replicas, disrupting) in marks.items():
        host = hosts[host_id]
        host.used, host.replicas, host.disrupting = used, replicas, disrupting
    tick.hosts, tick.usage, tick.seq = hosts, usage, seq


def _replace_host(tick: _Tick, host: _Host) -> tuple[list[NodeAction], bool]:
    """Place `host`'s replicas elsewhere (free room, else new nodes), keeping each model's on-demand base.

    An empty node is no room for them: it is on its way out (the empty-node grace), so moving replicas onto it
    saves nothing. The simulator, replaying the loop's drains, found the loop this made: a scale-down emptied a
    node, a consolidation filled it from another node, which then lay empty for the next consolidation to fill
    from, a cold start pair every three minutes and two nodes held for one's work.
    """
    actions: list[NodeAction] = []
    exclude = {host.id} | {h.id for h in tick.hosts.values() if h.running and not tick.live(h)}
    by_model: dict[str, int] = {}
    for r in tick.live(host):
        by_model[r.model] = by_model.get(r.model, 0) + 1
    for name, count in sorted(by_model.items()):
        model = tick.model(name)
        if model is None:
            return actions, False
        _, on_demand = _supply(tick, name)  # host is marked disrupting: its replicas do not count
        base = min(model.spec.placement.on_demand_base_replicas, tick.inputs.desired.get(name, 0))
        need_od = min(count, max(0, base - on_demand)) if model.spec.placement.allow_spot else 0
        for n, od_only in ((need_od, True), (count - need_od, False)):
            if n <= 0:
                continue
            placed, left, _ = _place(tick, model, n, od_only, "consolidation", exclude=exclude)
            actions.extend(placed)
            if left:
                return actions, False
    return actions, True


def _relabel(action: NodeAction, reason: str) -> NodeAction:
    if isinstance(action, (CreateNode, StartReplica)):
        return replace(action, reason=f"consolidation: {reason}")
    return action


def plan_nodes(inputs: PlannerInputs, state: PlannerState,
               now: float) -> tuple[PlannerState, list[NodeAction]]:
    """One planning tick: the new state and the actions, in the order to perform them.

    Order: deletes of interrupted nodes, stops of failed replicas, replacements and scale-up (starts,
    then node creations), scale-down stops, completed consolidations (stops, then the delete), empty
    node releases, then at most one new consolidation (its starts/creations).

    Contract: never returns a CreateNode for capacity already covered by a listed node or an input
    claim (claims carry LABEL_PLANNED_REPLICAS); a node being consolidated keeps its replicas until
    its models have `desired` ready replicas elsewhere; StartReplica only names RUNNING nodes; ids it
    mints (`{id_prefix}-n{seq}`, `{id_prefix}-r{seq}`) never repeat within one state lineage.
    """
    unavailable = {k: t for k, t in state.unavailable_until.items() if t > now}
    tick = _Tick(inputs, now, unavailable, state.next_seq)
    _index_hosts(tick)
    _index_replicas(tick)
    disruptions = _finish_disruptions(tick, state.disruptions)
    _scale_models(tick)
    disruptions = _complete_disruptions(tick, disruptions)
    empty_since = _release_empty(tick, state.empty_since)
    disruptions = _consolidate(tick, disruptions)
    new_state = PlannerState(unavailable_until=tick.unavailable, empty_since=empty_since,
                             disruptions=disruptions, next_seq=tick.seq)
    return new_state, tick.actions
