"""The live loop's pure fleet helpers (`autoscaler.fleet`), with worked examples."""

from __future__ import annotations

from kvgate.autoscaler.claims import ClaimPhase, ClaimRecord
from dataclasses import replace

from kvgate.autoscaler.fleet import booting_by_model
from kvgate.autoscaler.planner import LABEL_PLANNED_REPLICAS
from kvgate.providers.base import CapacityType, Node, NodeState, ReplicaHandle, ReplicaState, TAG_MODEL
from tests.autoscaler.fleet_helpers import POOL, claim


def record(claim_id: str, node_id: str | None, model: str | None = "m",
           phase: ClaimPhase = ClaimPhase.PENDING) -> ClaimRecord:
    return ClaimRecord(claim_id, phase, claim(claim_id, model=model), node_id, 0.0, 0.0, "me", 1)


def node(node_id: str, claim_id: str, state: NodeState = NodeState.RUNNING, tags: dict[str, str] | None = None) -> Node:
    return Node(node_id, claim_id, POOL, "g6.xlarge", CapacityType.ON_DEMAND, "z", state, None, tags or {}, 0.0, 1.0)


def replica(replica_id: str, node_id: str) -> ReplicaHandle:
    return ReplicaHandle(replica_id, "m", node_id, "", None, ReplicaState.STARTING, 0.0)


def test_claims_whose_node_is_not_listed_count_as_replicas_on_their_way() -> None:
    # c1's node is listed (its replica shows in the listing already); c2 has no node yet; c3 was confirmed
    # with a node the listing missed this tick; c4 names no model (nothing to count it for).
    claims = [record("c1", "n1"), record("c2", None), record("c3", "n3", phase=ClaimPhase.CONFIRMED),
              record("c4", None, model=None), record("c5", None, model="other")]
    assert booting_by_model([node("n1", "c1")], claims, []) == {"m": 2, "other": 1}


def test_claims_and_pending_nodes_count_the_replicas_they_were_bought_for() -> None:
    # A claim for 2 replicas of m with no node yet: 2. A listed node still booting, bought for 3 of m, with one
    # replica already listed on it (it boots into it): 2 more. A running node counts nothing: its replicas are
    # started by the planner and listed.
    two = record("c1", None)
    two = replace(two, claim=replace(two.claim, labels={**two.claim.labels, LABEL_PLANNED_REPLICAS: "2"}))
    tags = {TAG_MODEL: "m", LABEL_PLANNED_REPLICAS: "3"}
    nodes = [node("n2", "c2", NodeState.PENDING, tags), node("n3", "c3", NodeState.RUNNING, tags)]
    assert booting_by_model(nodes, [two], [replica("r1", "n2")]) == {"m": 4}
