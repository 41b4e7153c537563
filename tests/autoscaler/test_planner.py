"""The node planner as a specification: which offering, which fallback, what gets released, and how a
consolidation replaces a node (new before old). Pure calls with worked prices in the comments.

The registry is real YAML loaded by `registry.load_registry`; offerings come from the pools through
`providers.base.offerings_from_pool`, exactly as providers build them. Nodes and replicas are the
providers' value types, written by hand as a provider would list them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.autoscaler.planner import (LABEL_PLANNED_REPLICAS, CreateNode, DeleteNode, NodeAction, PlannerInputs,
                                PlannerSettings, PlannerState, StartReplica, StopReplica, Unschedulable,
                                note_insufficient_capacity, plan_nodes)
from kvgate.providers.base import (CapacityType, Node, NodeClaim, NodeState, Offering, OfferingKey, ReplicaHandle,
                            ReplicaState, offerings_from_pool)
from kvgate.registry import Snapshot, load_registry

OD, SPOT = CapacityType.ON_DEMAND, CapacityType.SPOT
T0 = 1_700_000_000.0  # wall seconds; nodes below were launched an hour before

# Prices ($/h). east: L40S x1 on-demand 2.00 and spot 0.80 in zones a and b; L40S x4 on-demand 7.00
# (1.75 per GPU); H100 x8 on-demand 30.00. west: L40S x1 on-demand 2.40, spot 1.00.
REGISTRY = """
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: east}}
spec:
  provider: fake
  region: us-east-1
  {east_limits}
  offers:
    - {{instance_type: l40s-1, gpu_kind: L40S, gpu_count: 1, gpu_memory_gib: 48, price_usd_per_hour: 2.00, zones: [a, b]}}
    - {{instance_type: l40s-1, gpu_kind: L40S, gpu_count: 1, gpu_memory_gib: 48, price_usd_per_hour: 0.80,
       capacity_type: spot, zones: [a, b]}}
    - {{instance_type: l40s-4, gpu_kind: L40S, gpu_count: 4, gpu_memory_gib: 48, price_usd_per_hour: 7.00, zones: [a]}}
    - {{instance_type: h100-8, gpu_kind: H100, gpu_count: 8, gpu_memory_gib: 80, price_usd_per_hour: 30.00, zones: [a]}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: west}}
spec:
  provider: fake
  region: us-west-2
  offers:
    - {{instance_type: l40s-1, gpu_kind: L40S, gpu_count: 1, gpu_memory_gib: 48, price_usd_per_hour: 2.40}}
    - {{instance_type: l40s-1, gpu_kind: L40S, gpu_count: 1, gpu_memory_gib: 48, price_usd_per_hour: 1.00,
       capacity_type: spot}}
---
apiVersion: kvgate/v1
kind: Model
metadata: {{name: chat}}
spec:
  source: s3://m/chat
  resources: {{gpu_kinds: [L40S, H100], gpu_count: 1, min_gpu_memory_gib: 40}}
  scaling: {{min_replicas: 0, max_replicas: 20, max_queue_wait_s: 60}}
  placement: {{allow_spot: true, on_demand_base_replicas: 1}}
---
apiVersion: kvgate/v1
kind: Model
metadata: {{name: steady}}
spec:
  source: s3://m/steady
  resources: {{gpu_kinds: [L40S], gpu_count: 1}}
  scaling: {{min_replicas: 1, max_replicas: 20}}
  placement: {{pools: [east]}}
---
apiVersion: kvgate/v1
kind: Model
metadata: {{name: big}}
spec:
  source: s3://m/big
  resources: {{gpu_kinds: [H100], gpu_count: 4, min_gpu_memory_gib: 80}}
  scaling: {{min_replicas: 0, max_replicas: 4, max_queue_wait_s: 60}}
"""


def registry(tmp_path: Path, east_limits: str = "") -> Snapshot:
    (tmp_path / "r.yaml").write_text(REGISTRY.format(east_limits=east_limits or "max_nodes: 20"))
    return load_registry(tmp_path)


def offerings(snap: Snapshot, sold_out: tuple[str, ...] = ()) -> tuple[Offering, ...]:
    out = []
    for name, pool in snap.pools.items():
        for o in offerings_from_pool(name, pool.spec):
            out.append(replace(o, available=str(o.key) not in sold_out))
    return tuple(out)


def node(node_id: str, key: str, state: NodeState = NodeState.RUNNING, *, model: str | None = None,
         planned: int = 1, price: float = 0.0, age_s: float = 3600.0, reason: str = "") -> Node:
    pool, itype, cap, *zone = key.split(":")
    tags = {"kvgate:claim": f"c-{node_id}", LABEL_PLANNED_REPLICAS: str(planned)}
    if model:
        tags["kvgate:model"] = model
    return Node(node_id, f"c-{node_id}", pool, itype, CapacityType(cap), (zone or [""])[0].lstrip("/"), state,
                "10.0.0.1", tags, T0 - age_s, price, reason)


def replica(rid: str, model: str, node_id: str, state: ReplicaState = ReplicaState.READY) -> ReplicaHandle:
    return ReplicaHandle(rid, model, node_id, f"http://{rid}", None, state, T0)


def plan(snap: Snapshot, desired: dict[str, int], *, nodes: tuple[Node, ...] = (), replicas: tuple[ReplicaHandle, ...] = (),
         claims: tuple[NodeClaim, ...] = (), state: PlannerState | None = None, now: float = T0,
         sold_out: tuple[str, ...] = (), settings: PlannerSettings = PlannerSettings(),
         leaving: tuple[ReplicaHandle, ...] = ()) -> tuple[PlannerState, list[NodeAction]]:
    inputs = PlannerInputs(snap, desired, nodes, replicas, offerings(snap, sold_out), claims, settings, "t", leaving)
    return plan_nodes(inputs, state or PlannerState(), now)


def bought(actions: list[NodeAction]) -> list[tuple[str, str]]:
    """(offering, planned replicas) of every CreateNode, e.g. ("east:l40s-1:spot/a", "1")."""
    return [(str(a.claim.offering), a.claim.labels[LABEL_PLANNED_REPLICAS]) for a in actions if isinstance(a, CreateNode)]


# -------------------------------------------------------------------------------------- choice by price


@pytest.mark.parametrize("desired,expected", [
    # steady may only use east on-demand: 1 replica -> l40s-1 at $2.00 (zone a before b on a tie).
    ({"steady": 1}, [("east:l40s-1:on_demand/a", "1")]),
    # 3 replicas: l40s-1 is $2.00 per replica, l40s-4 holding 3 is 7/3 = $2.33: three l40s-1.
    ({"steady": 3}, [("east:l40s-1:on_demand/a", "1")] * 3),
    # 4 replicas: l40s-4 holding 4 is 7/4 = $1.75 per replica < $2.00: one l40s-4.
    ({"steady": 4}, [("east:l40s-4:on_demand/a", "4")]),
    # chat: spot allowed with an on-demand base of 1: 1 on-demand ($2.00), the rest on spot ($0.80).
    ({"chat": 3}, [("east:l40s-1:on_demand/a", "1"), ("east:l40s-1:spot/a", "1"), ("east:l40s-1:spot/a", "1")]),
    # big needs 4 x H100 with 80 GiB: only h100-8 fits, and it holds 2 replicas ($15 per replica).
    ({"big": 2}, [("east:h100-8:on_demand/a", "2")]),
])
def test_claims_get_the_cheapest_compatible_offering_per_replica(tmp_path: Path, desired: dict[str, int],
                                                                 expected: list[tuple[str, str]]) -> None:
    _, actions = plan(registry(tmp_path), desired)
    assert bought(actions) == expected


def test_sold_out_offerings_are_skipped(tmp_path: Path) -> None:
    # east on-demand l40s-1 sold out in both zones: chat's base goes to west on-demand ($2.40), which
    # beats the l40s-4 ($7.00 for 1 replica).
    _, actions = plan(registry(tmp_path), {"chat": 1},
                      sold_out=("east:l40s-1:on_demand/a", "east:l40s-1:on_demand/b"))
    assert bought(actions) == [("west:l40s-1:on_demand", "1")]


def test_every_claim_carries_the_replica_spec_of_its_model(tmp_path: Path) -> None:
    # A node that boots straight into its replica (AWS cloud-init) learns which engine to start only
    # from its claim: without the spec it boots with nothing to serve.
    _, actions = plan(registry(tmp_path), {"steady": 1})
    [create] = [a for a in actions if isinstance(a, CreateNode)]
    assert create.claim.replica is not None
    assert (create.claim.replica.model, create.claim.replica.source) == ("steady", "s3://m/steady")


def boot_offerings(snap: Snapshot) -> tuple[Offering, ...]:
    """Every offering flagged replica_at_boot, as the AWS provider lists them."""
    return tuple(replace(o, replica_at_boot=True) for o in offerings(snap))


def test_a_node_that_boots_its_replica_is_bought_per_replica_whatever_its_size(tmp_path: Path) -> None:
    # steady x4 would fit one l40s-4 ($1.75 per replica), but a replica_at_boot node runs one replica:
    # l40s-4 is then $7.00 per replica against $2.00 for l40s-1, so four l40s-1 with one replica each.
    snap = registry(tmp_path)
    inputs = PlannerInputs(snap, {"steady": 4}, (), (), boot_offerings(snap), (), PlannerSettings(), "t")
    _, actions = plan_nodes(inputs, PlannerState(), T0)
    assert bought(actions) == [("east:l40s-1:on_demand/a", "1")] * 4


def test_a_node_that_boots_its_replica_hosts_no_other_replica(tmp_path: Path) -> None:
    # n4 (l40s-4, 4 GPUs) booted into its steady replica r1 and has 3 GPUs free. On a node that starts
    # replicas separately, chat and a 2nd steady would go there; here each needs its own node.
    snap = registry(tmp_path)
    nodes = (node("n4", "east:l40s-4:on_demand:a", model="steady", price=7.0),)
    reps = (replica("r1", "steady", "n4"),)
    inputs = PlannerInputs(snap, {"steady": 2, "chat": 1}, nodes, reps, boot_offerings(snap), (), PlannerSettings(), "t")
    _, actions = plan_nodes(inputs, PlannerState(), T0)
    assert not [a for a in actions if isinstance(a, StartReplica)]
    assert sorted(a.claim.model for a in actions if isinstance(a, CreateNode)) == ["chat", "steady"]


def test_a_booted_node_gets_its_planned_replica_started(tmp_path: Path) -> None:
    # The node bought for steady is running with no replica adopted yet: the planner starts (adopts) it there.
    snap = registry(tmp_path)
    nodes = (node("n1", "east:l40s-1:on_demand:a", model="steady", price=2.0),)
    inputs = PlannerInputs(snap, {"steady": 1}, nodes, (), boot_offerings(snap), (), PlannerSettings(), "t")
    _, actions = plan_nodes(inputs, PlannerState(), T0)
    assert [(type(a).__name__, getattr(a, "node_id", None)) for a in actions] == [("StartReplica", "n1")]


def boot_node(node_id: str, key: str, *, model: str, replica: str | None, price: float) -> Node:
    """A node that booted into its replica, as the AWS provider lists it: `replica` is the id its boot replica
    was adopted under (None: not adopted yet, the tag still holds the claim id)."""
    base = node(node_id, key, model=model, price=price)
    return replace(base, tags={**base.tags, "kvgate:replica": replica or base.claim_id})


def boot_plan(snap: Snapshot, desired: dict[str, int], nodes: tuple[Node, ...], replicas: tuple[ReplicaHandle, ...],
              ) -> list[NodeAction]:
    inputs = PlannerInputs(snap, desired, nodes, replicas, boot_offerings(snap), (), PlannerSettings(), "t")
    return plan_nodes(inputs, PlannerState(), T0)[1]


def test_a_boot_node_whose_replica_is_being_stopped_is_no_room(tmp_path: Path) -> None:
    # Scale-down from 2 to 1 stops one of r1, r2. Stopping it terminates its node, so nothing may start on
    # that node in the same tick, a consolidation's replacement included.
    snap = registry(tmp_path)
    nodes = (boot_node("n1", "east:l40s-1:on_demand:a", model="steady", replica="r1", price=2.0),
             boot_node("n4", "east:l40s-4:on_demand:a", model="steady", replica="r2", price=7.0))
    actions = boot_plan(snap, {"steady": 1}, nodes, (replica("r1", "steady", "n1"), replica("r2", "steady", "n4")))
    [stop] = [a for a in actions if isinstance(a, StopReplica)]
    assert not [a for a in actions if isinstance(a, StartReplica) and a.node_id == stop.node_id]


def test_a_boot_node_whose_replica_is_draining_or_failed_is_no_room(tmp_path: Path) -> None:
    # r1 was adopted on n1 and is draining (the loop leaves draining replicas out of the planner's inputs);
    # demand came back: n1 looks empty but its replica is gone with it, so a new node is bought.
    snap = registry(tmp_path)
    draining = (boot_node("n1", "east:l40s-1:on_demand:a", model="steady", replica="r1", price=2.0),)
    actions = boot_plan(snap, {"steady": 1}, draining, ())
    assert not [a for a in actions if isinstance(a, StartReplica)]
    assert [a.claim.model for a in actions if isinstance(a, CreateNode)] == ["steady"]
    # The boot replica failed before anyone adopted it: stop it (the node goes), start nothing there.
    fresh = (boot_node("n2", "east:l40s-1:on_demand:a", model="steady", replica=None, price=2.0),)
    failed = (replica("c-n2", "steady", "n2", ReplicaState.FAILED),)
    actions = boot_plan(snap, {"steady": 1}, fresh, failed)
    assert [type(a).__name__ for a in actions if not isinstance(a, CreateNode)] == ["StopReplica"]
    assert all(a.boots_replica for a in actions if isinstance(a, CreateNode))


# ------------------------------------------------------------------------ insufficient capacity fallback


def test_insufficient_capacity_moves_the_claim_to_the_next_offering_and_back_after_180_s(tmp_path: Path) -> None:
    # chat with 2 replicas: base on-demand + 1 spot. Spot in east/a fails -> east/b; east/b fails too ->
    # west spot ($1.00); 180 s after the first failure east/a is tried again.
    snap = registry(tmp_path)
    spot_a = OfferingKey("east", "l40s-1", SPOT, "a")
    spot_b = OfferingKey("east", "l40s-1", SPOT, "b")
    od = (node("n-od", "east:l40s-1:on_demand:a", price=2.0),)
    reps = (replica("r-od", "chat", "n-od"),)
    state = note_insufficient_capacity(PlannerState(), spot_a, T0)
    state, actions = plan(snap, {"chat": 2}, nodes=od, replicas=reps, state=state, now=T0 + 1)
    assert bought(actions) == [("east:l40s-1:spot/b", "1")]
    state = note_insufficient_capacity(state, spot_b, T0 + 2)
    state, actions = plan(snap, {"chat": 2}, nodes=od, replicas=reps, state=state, now=T0 + 3)
    assert bought(actions) == [("west:l40s-1:spot", "1")]
    _, actions = plan(snap, {"chat": 2}, nodes=od, replicas=reps, state=state, now=T0 + 179)
    assert bought(actions) == [("west:l40s-1:spot", "1")]  # a is still skipped at 179 s
    state, actions = plan(snap, {"chat": 2}, nodes=od, replicas=reps, state=state, now=T0 + 180)
    assert bought(actions) == [("east:l40s-1:spot/a", "1")]
    assert spot_a not in state.unavailable_until  # expired entries are dropped


# ----------------------------------------------------------------------------------------- preemption


def test_a_preempted_spot_node_is_deleted_and_its_replica_replaced_elsewhere_at_once(tmp_path: Path) -> None:
    # chat 2 replicas: on-demand base on n-od, one on spot n-sp (east/a). n-sp is interrupted: delete it,
    # skip east spot/a for 180 s (Karpenter does the same after an interruption), buy east spot/b now.
    snap = registry(tmp_path)
    nodes = (node("n-od", "east:l40s-1:on_demand:a", price=2.0),
             node("n-sp", "east:l40s-1:spot:a", NodeState.INTERRUPTED, price=0.8, reason="spot notice"))
    reps = (replica("r-od", "chat", "n-od"), replica("r-sp", "chat", "n-sp"))
    state, actions = plan(snap, {"chat": 2}, nodes=nodes, replicas=reps)
    assert isinstance(actions[0], DeleteNode) and actions[0].node_id == "n-sp" and "preempted" in actions[0].reason
    assert bought(actions) == [("east:l40s-1:spot/b", "1")]
    assert state.unavailable_until[OfferingKey("east", "l40s-1", SPOT, "a")] == T0 + 180


def test_failed_replicas_are_stopped_and_replaced_on_free_room(tmp_path: Path) -> None:
    # An l40s-4 node holds 2 steady replicas; one failed. Stop it; start a new one on the free GPUs
    # (no purchase: the node has 4 - 1 = 3 GPUs free).
    snap = registry(tmp_path)
    nodes = (node("n4", "east:l40s-4:on_demand:a", price=7.0),)
    reps = (replica("r1", "steady", "n4"), replica("r2", "steady", "n4", ReplicaState.FAILED))
    _, actions = plan(snap, {"steady": 2}, nodes=nodes, replicas=reps)
    assert [type(a).__name__ for a in actions] == ["StopReplica", "StartReplica"]
    assert actions[1] == StartReplica("steady", "n4", "t-r1", actions[1].reason)


# ---------------------------------------------------------------------------------------- no double buy


def test_a_claim_in_flight_or_a_booting_node_is_not_bought_again(tmp_path: Path) -> None:
    snap = registry(tmp_path)
    claim = NodeClaim("t-n1", OfferingKey("east", "l40s-1", OD, "a"), model="steady",
                      labels={LABEL_PLANNED_REPLICAS: "1"})
    _, actions = plan(snap, {"steady": 1}, claims=(claim,))
    assert actions == []
    booting = node("n1", "east:l40s-1:on_demand:a", NodeState.PENDING, model="steady", price=2.0)
    _, actions = plan(snap, {"steady": 1}, nodes=(booting,), claims=(claim,))
    assert actions == []
    # once running, the reserved node gets the replica
    running = replace(booting, state=NodeState.RUNNING)
    _, actions = plan(snap, {"steady": 1}, nodes=(running,))
    assert [(type(a).__name__, getattr(a, "node_id", "")) for a in actions] == [("StartReplica", "n1")]


# ------------------------------------------------------------------------------------- quota and budget


@pytest.mark.parametrize("limits,wanted,expected_buys,why", [
    # max_nodes 2: two l40s-1 nodes, the third replica cannot go anywhere (steady is east-only).
    ("max_nodes: 2", 3, 2, "max_nodes: 2 + 1 > 2"),
    # max_gpus 3: 4 replicas would be one l40s-4 (4 GPUs > 3) -> three l40s-1 instead, then stuck.
    ("max_gpus: 3", 4, 3, "max_gpus: 3 + 1 > 3"),
    # budget $5/h: two l40s-1 ($4.00), a third would make $6.00 > $5.00.
    ("budget_usd_per_hour: 5", 3, 2, "budget: 4.00 + 2.00 > 5.00 $/h"),
])
def test_quota_and_budget_limit_what_is_bought(tmp_path: Path, limits: str, wanted: int, expected_buys: int,
                                               why: str) -> None:
    _, actions = plan(registry(tmp_path, limits), {"steady": wanted})
    assert len(bought(actions)) == expected_buys
    blocked = [a for a in actions if isinstance(a, Unschedulable)]
    assert len(blocked) == 1 and blocked[0].replicas == wanted - expected_buys
    assert why in blocked[0].reason


def test_existing_nodes_count_against_the_quota(tmp_path: Path) -> None:
    snap = registry(tmp_path, "max_nodes: 1")
    nodes = (node("n1", "east:l40s-1:on_demand:a", price=2.0),)
    _, actions = plan(snap, {"steady": 2}, nodes=nodes, replicas=(replica("r1", "steady", "n1"),))
    assert bought(actions) == [] and isinstance(actions[-1], Unschedulable)


# ------------------------------------------------------------------------------- spot with on-demand base


def test_scale_down_keeps_the_on_demand_base(tmp_path: Path) -> None:
    # chat has 1 on-demand + 2 spot replicas, desired 1: the two spot ones stop, the base stays.
    snap = registry(tmp_path)
    nodes = (node("n-od", "east:l40s-1:on_demand:a", price=2.0), node("s1", "east:l40s-1:spot:a", price=0.8),
             node("s2", "east:l40s-1:spot:b", price=0.8))
    reps = (replica("r-od", "chat", "n-od"), replica("r1", "chat", "s1"), replica("r2", "chat", "s2"))
    _, actions = plan(snap, {"chat": 1}, nodes=nodes, replicas=reps)
    assert sorted(a.replica_id for a in actions if isinstance(a, StopReplica)) == ["r1", "r2"]


def test_the_base_is_restored_on_demand_even_when_spot_replicas_exist(tmp_path: Path) -> None:
    # chat wants 3 and has 3 on spot, 0 on-demand: enough replicas, so nothing is bought; with 4 wanted
    # the one missing replica must be on-demand (base 1).
    snap = registry(tmp_path)
    nodes = tuple(node(f"s{i}", "east:l40s-1:spot:a", price=0.8) for i in range(3))
    reps = tuple(replica(f"r{i}", "chat", f"s{i}") for i in range(3))
    _, actions = plan(snap, {"chat": 3}, nodes=nodes, replicas=reps)
    assert actions == []
    _, actions = plan(snap, {"chat": 4}, nodes=nodes, replicas=reps)
    assert bought(actions) == [("east:l40s-1:on_demand/a", "1")]


# -------------------------------------------------------------------------------------- empty nodes


def test_an_empty_node_is_released_after_the_grace(tmp_path: Path) -> None:
    snap = registry(tmp_path)
    nodes = (node("n1", "east:l40s-1:on_demand:a", price=2.0),)
    state, actions = plan(snap, {}, nodes=nodes, now=T0)
    assert actions == [] and state.empty_since == {"n1": T0}
    state, actions = plan(snap, {}, nodes=nodes, state=state, now=T0 + 119)
    assert actions == []
    state, actions = plan(snap, {}, nodes=nodes, state=state, now=T0 + 120)  # grace 120 s
    assert actions == [DeleteNode("n1", "east", "empty for 120s >= 120s")]


def test_a_node_that_gets_a_replica_again_restarts_its_grace(tmp_path: Path) -> None:
    snap = registry(tmp_path)
    nodes = (node("n1", "east:l40s-1:on_demand:a", price=2.0),)
    state, _ = plan(snap, {}, nodes=nodes, now=T0)
    state, actions = plan(snap, {"steady": 1}, nodes=nodes, state=state, now=T0 + 60)
    assert isinstance(actions[0], StartReplica) and state.empty_since == {}


# ------------------------------------------------------------------------------------------- consolidation


def test_consolidation_starts_the_replacement_before_stopping_the_old_node(tmp_path: Path) -> None:
    # One steady replica sits alone on an l40s-4 ($7.00/h). An l40s-1 ($2.00/h) saves 71 % >= 20 %:
    # tick 1 buys the l40s-1 and marks the old node as disrupted; nothing is stopped.
    # tick 2 (claim in flight) and tick 3 (node booting): nothing new.
    # tick 4 (node running): start the replica there. tick 5 (it is starting): still nothing stops.
    # tick 6 (it is ready): stop the old replica. tick 7 (it drains, `leaving`): the node stays.
    # tick 8 (it is gone): delete the old node.
    snap = registry(tmp_path)
    old = node("n4", "east:l40s-4:on_demand:a", price=7.0)
    r_old = replica("r-old", "steady", "n4")
    state, actions = plan(snap, {"steady": 1}, nodes=(old,), replicas=(r_old,))
    assert bought(actions) == [("east:l40s-1:on_demand/a", "1")]
    assert "consolidation" in actions[0].reason and [d.node_id for d in state.disruptions] == ["n4"]
    claim = actions[0].claim
    state, actions = plan(snap, {"steady": 1}, nodes=(old,), replicas=(r_old,), claims=(claim,), state=state, now=T0 + 10)
    assert actions == []
    new = Node("n1", claim.id, "east", "l40s-1", OD, "a", NodeState.PENDING, None,
               {"kvgate:model": "steady", LABEL_PLANNED_REPLICAS: "1"}, T0 + 20, 2.0)
    state, actions = plan(snap, {"steady": 1}, nodes=(old, new), replicas=(r_old,), state=state, now=T0 + 20)
    assert actions == []
    new = replace(new, state=NodeState.RUNNING)
    state, actions = plan(snap, {"steady": 1}, nodes=(old, new), replicas=(r_old,), state=state, now=T0 + 100)
    assert [(type(a).__name__, a.node_id) for a in actions] == [("StartReplica", "n1")]
    r_new = replica(actions[0].replica_id, "steady", "n1", ReplicaState.STARTING)
    state, actions = plan(snap, {"steady": 1}, nodes=(old, new), replicas=(r_old, r_new), state=state, now=T0 + 110)
    assert actions == []
    r_new = replace(r_new, state=ReplicaState.READY)
    state, actions = plan(snap, {"steady": 1}, nodes=(old, new), replicas=(r_old, r_new), state=state, now=T0 + 150)
    assert [(type(a).__name__, a.replica_id) for a in actions] == [("StopReplica", "r-old")]
    state, actions = plan(snap, {"steady": 1}, nodes=(old, new), replicas=(r_new,), leaving=(r_old,), state=state,
                          now=T0 + 152)
    assert actions == [] and [d.node_id for d in state.disruptions] == ["n4"]
    state, actions = plan(snap, {"steady": 1}, nodes=(old, new), replicas=(r_new,), state=state, now=T0 + 160)
    assert [(type(a).__name__, a.node_id) for a in actions] == [("DeleteNode", "n4")]
    assert state.disruptions == ()


def test_a_draining_replica_holds_its_room_and_its_node(tmp_path: Path) -> None:
    # An l40s-1 whose one replica drains (`leaving`): its GPU is not room for a new replica (a second steady replica
    # buys a node), and the node, empty to the planner, is not deleted after the 120 s grace until the drain ends;
    # then at once, the grace having run since the drain began.
    snap = registry(tmp_path)
    n1 = node("n1", "east:l40s-1:on_demand:a", price=2.0)
    r1 = replica("r1", "steady", "n1")
    _, actions = plan(snap, {"steady": 1}, nodes=(n1,), leaving=(r1,))
    assert bought(actions) == [("east:l40s-1:on_demand/a", "1")]
    state, actions = plan(snap, {"steady": 0}, nodes=(n1,), leaving=(r1,))
    assert actions == [] and state.empty_since == {"n1": T0}
    state, actions = plan(snap, {"steady": 0}, nodes=(n1,), leaving=(r1,), state=state, now=T0 + 200)
    assert actions == []
    _, actions = plan(snap, {"steady": 0}, nodes=(n1,), state=state, now=T0 + 201)
    assert actions == [DeleteNode("n1", "east", "empty for 201s >= 120s")]


def test_consolidation_onto_free_room_deletes_the_underused_node(tmp_path: Path) -> None:
    # Two l40s-4 nodes ($7.00 each) with 1 and 2 steady replicas: the first one's replica fits in the
    # second's free GPUs, saving the whole $7.00: start it there (no purchase).
    snap = registry(tmp_path)
    nodes = (node("a", "east:l40s-4:on_demand:a", price=7.0), node("b", "east:l40s-4:on_demand:a", price=7.0))
    reps = (replica("r1", "steady", "a"), replica("r2", "steady", "b"), replica("r3", "steady", "b"))
    state, actions = plan(snap, {"steady": 3}, nodes=nodes, replicas=reps)
    assert bought(actions) == []
    assert [(type(a).__name__, a.node_id) for a in actions] == [("StartReplica", "b")]
    assert [d.node_id for d in state.disruptions] == ["a"]


def test_a_node_released_as_empty_is_not_room_for_a_consolidation_in_the_same_tick(tmp_path: Path) -> None:
    # "b" (l40s-4, $7.00) has been empty past the grace and is deleted; "a" (l40s-4, $7.00) holds one
    # steady replica that would fit in b's free GPUs. Found by the simulator: the same tick deleted b and
    # started a's replica on it. Now a's consolidation must buy an l40s-1 ($2.00) instead.
    snap = registry(tmp_path)
    nodes = (node("a", "east:l40s-4:on_demand:a", price=7.0), node("b", "east:l40s-4:on_demand:a", price=7.0))
    reps = (replica("r1", "steady", "a"),)
    state, _ = plan(snap, {"steady": 1}, nodes=nodes, replicas=reps, now=T0,
                    settings=PlannerSettings(consolidation_enabled=False))
    assert state.empty_since == {"b": T0}
    _, actions = plan(snap, {"steady": 1}, nodes=nodes, replicas=reps, state=state, now=T0 + 120)
    assert DeleteNode("b", "east", "empty for 120s >= 120s") in actions
    assert not any(isinstance(a, StartReplica) and a.node_id == "b" for a in actions), actions
    assert bought(actions) == [("east:l40s-1:on_demand/a", "1")]


def test_a_replica_stopped_this_tick_drains_before_its_node_goes_even_with_no_grace(tmp_path: Path) -> None:
    # Grace 0: the node whose last replica the scale-down stops is not deleted in the same tick (that would cut the
    # drain); it goes once the replica has left.
    snap = registry(tmp_path)
    n1 = node("n1", "east:l40s-1:on_demand:a", price=2.0)
    r1 = replica("r1", "steady", "n1")
    no_grace = PlannerSettings(empty_node_grace_s=0.0, consolidation_enabled=False)
    state, actions = plan(snap, {"steady": 0}, nodes=(n1,), replicas=(r1,), settings=no_grace)
    assert [type(a).__name__ for a in actions] == ["StopReplica"]
    _, actions = plan(snap, {"steady": 0}, nodes=(n1,), state=state, settings=no_grace, now=T0 + 3)
    assert [type(a).__name__ for a in actions] == ["DeleteNode"]


def test_an_empty_node_is_no_room_for_a_consolidation(tmp_path: Path) -> None:
    # "b" (l40s-4, $7.00) has just been emptied by a scale-down (its replicas drain, out of the planner's view)
    # and waits out the empty-node grace; "a" (l40s-4, $7.00, one steady replica) would fit in b's GPUs. Moving
    # it there saves nothing (b goes anyway) and empties a for the next consolidation to fill from b: the
    # simulator found that ping-pong. a's consolidation buys an l40s-1 ($2.00, saves 71 %) instead.
    snap = registry(tmp_path)
    nodes = (node("a", "east:l40s-4:on_demand:a", price=7.0), node("b", "east:l40s-4:on_demand:a", price=7.0))
    _, actions = plan(snap, {"steady": 1}, nodes=nodes, replicas=(replica("r1", "steady", "a"),), now=T0)
    assert not any(isinstance(a, StartReplica) and a.node_id == "b" for a in actions), actions
    assert bought(actions) == [("east:l40s-1:on_demand/a", "1")]


def test_consolidation_respects_the_disruption_budget_and_the_minimum_saving(tmp_path: Path) -> None:
    # Two l40s-4 nodes, each with one steady replica: each could become an l40s-1 (saves 71 %), but the
    # budget is one node at a time. And an l40s-1 with one replica is never replaced (nothing cheaper
    # by 20 %: spot is not allowed for steady).
    snap = registry(tmp_path)
    nodes = (node("a", "east:l40s-4:on_demand:a", price=7.0), node("b", "east:l40s-4:on_demand:a", price=7.0),
             node("c", "east:l40s-1:on_demand:a", price=2.0))
    reps = (replica("r1", "steady", "a"), replica("r2", "steady", "b"), replica("r3", "steady", "c"))
    state, actions = plan(snap, {"steady": 3}, nodes=nodes, replicas=reps)
    assert len(state.disruptions) == 1
    # the first pays most from moving onto b's free room: no purchase, a's replica goes to b
    assert bought(actions) == []
    # while it is in flight no second one starts
    _, actions = plan(snap, {"steady": 3}, nodes=nodes, replicas=reps, state=state, now=T0 + 5)
    assert not any(isinstance(a, CreateNode) for a in actions)


def test_young_nodes_and_busy_fleets_are_not_consolidated(tmp_path: Path) -> None:
    snap = registry(tmp_path)
    young = (node("a", "east:l40s-4:on_demand:a", price=7.0, age_s=60),)
    reps = (replica("r1", "steady", "a"),)
    state, actions = plan(snap, {"steady": 1}, nodes=young, replicas=reps)
    assert actions == [] and state.disruptions == ()
    # a replica still starting anywhere: the fleet is not steady, judge it later
    old = (node("a", "east:l40s-4:on_demand:a", price=7.0),)
    starting = (replica("r1", "steady", "a", ReplicaState.STARTING),)
    state, actions = plan(snap, {"steady": 1}, nodes=old, replicas=starting)
    assert actions == [] and state.disruptions == ()


def test_unknown_models_replicas_are_stopped(tmp_path: Path) -> None:
    snap = registry(tmp_path)
    nodes = (node("n1", "east:l40s-1:on_demand:a", price=2.0),)
    _, actions = plan(snap, {}, nodes=nodes, replicas=(replica("r1", "gone", "n1"),))
    assert [(type(a).__name__, a.replica_id) for a in actions] == [("StopReplica", "r1")]


def test_a_node_bought_for_a_model_gets_its_replica_before_cheaper_room_elsewhere(tmp_path: Path) -> None:
    # An l40s-4 ($1.75 per GPU) has 3 free GPUs, but n1 (an l40s-1, $2.00) was bought for steady's
    # second replica: that replica goes to n1, or n1 would sit empty and the purchase be wasted.
    snap = registry(tmp_path)
    nodes = (node("big", "east:l40s-4:on_demand:a", price=7.0),
             node("n1", "east:l40s-1:on_demand:a", model="steady", price=2.0, age_s=30))
    _, actions = plan(snap, {"steady": 2}, nodes=nodes, replicas=(replica("r1", "steady", "big"),))
    assert [(type(a).__name__, a.node_id) for a in actions] == [("StartReplica", "n1")]
