"""The live loop's pure fleet helpers (`autoscaler.fleet`), with worked examples."""

from __future__ import annotations

from kvgate.autoscaler.claims import ClaimPhase, ClaimRecord
from kvgate.autoscaler.fleet import pending_claims_by_model
from kvgate.providers.base import CapacityType, Node, NodeState
from tests.autoscaler.fleet_helpers import POOL, claim


def record(claim_id: str, node_id: str | None, model: str | None = "m",
           phase: ClaimPhase = ClaimPhase.PENDING) -> ClaimRecord:
    return ClaimRecord(claim_id, phase, claim(claim_id, model=model), node_id, 0.0, 0.0, "me", 1)


def node(node_id: str, claim_id: str) -> Node:
    return Node(node_id, claim_id, POOL, "g6.xlarge", CapacityType.ON_DEMAND, "z", NodeState.RUNNING, None, {}, 0.0, 1.0)


def test_claims_whose_node_is_not_listed_count_as_replicas_on_their_way() -> None:
    # c1's node is listed (its replica shows in the listing already); c2 has no node yet; c3 was confirmed
    # with a node the listing missed this tick; c4 names no model (nothing to count it for).
    claims = [record("c1", "n1"), record("c2", None), record("c3", "n3", phase=ClaimPhase.CONFIRMED),
              record("c4", None, model=None), record("c5", None, model="other")]
    assert pending_claims_by_model([node("n1", "c1")], claims) == {"m": 2, "other": 1}
