"""The simulator's node layer: `kvgate sim` runs the live node planner (`plan_nodes`) on simulated nodes.

Registry: examples/sim (chat-70b: 4 x H100 per replica, so two replicas per 8-GPU node; on-demand base 2;
p5 spot $31.50/h, gpucloud on-demand $49.24/h, p5 on-demand $55.04/h; gpucloud boots in 90 s, the
model loads in 90 s). In-process and deterministic; a few hundred simulated seconds each.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.autoscaler.sim.baselines import StaticPolicy
from kvgate.autoscaler.sim.compare import build_fleet
from kvgate.autoscaler.sim.engine import simulate
from kvgate.autoscaler.sim.records import FleetSetup, Scenario, Stockout
from kvgate.autoscaler.sim.nodes import node_planning
from kvgate.autoscaler.sim.traces import Request, Trace
from kvgate.registry import load_registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"


def _planned_fleet(initial: int) -> FleetSetup:
    snapshot = load_registry(EXAMPLES)
    fleet = build_fleet(snapshot, "chat-70b", initial_replicas=initial)
    return replace(fleet, nodes=node_planning(snapshot, "chat-70b"), tail_s=60.0)


def _steady(n: int) -> Trace:
    return Trace("steady", tuple(Request(float(i), 200, 20) for i in range(n)))


def test_planner_buys_the_on_demand_base_and_spot_by_the_node() -> None:
    # 4 replicas warm at t=0: the base (2) on one gpucloud on-demand node, 2 more on one p5 spot node.
    result = simulate(_steady(600), _planned_fleet(4), StaticPolicy(4, tick_s=1.0))
    hours = (599 + 60) / 3600
    assert result.gpu_seconds == pytest.approx(2 * 8 * 659)  # whole nodes are charged, not replica shares
    assert result.cost_usd == pytest.approx((49.24 + 31.50) * hours)
    assert result.cold_starts == 0 and all(not math.isnan(t) for t in result.ttft_s)


def test_a_sold_out_offering_is_skipped_and_the_claim_moves_to_the_next_cheapest() -> None:
    # p5 spot is sold out all along: the planner's claim for it fails (noted as insufficient capacity)
    # and the next tick buys the next cheapest, gpucloud on-demand: both nodes are $49.24/h.
    scenario = Scenario(stockouts=(Stockout("aws-us-east-1/p5.48xlarge/spot", 0.0, 1e9),))
    result = simulate(_steady(600), _planned_fleet(0), StaticPolicy(4, tick_s=1.0), scenario)
    assert result.cost_usd / (result.gpu_seconds / 3600) == pytest.approx(49.24 / 8)
    assert result.cold_starts == 4  # 90 s boot + 90 s load: requests wait, none is lost
    assert all(not math.isnan(t) for t in result.ttft_s)


def test_preempted_spot_nodes_are_replaced_and_their_requests_served() -> None:
    scenario = Scenario(spot_interruptions_per_hour=20.0, seed=3)  # a spot node lives ~3 min on average
    result = simulate(_steady(900), _planned_fleet(4), StaticPolicy(4, tick_s=1.0), scenario)
    assert result.preemptions >= 2
    assert result.cold_starts >= 2 * result.preemptions - 2  # each lost node's 2 replicas restart elsewhere
    assert all(not math.isnan(t) for t in result.ttft_s)  # requeued and served


def test_empty_nodes_are_released_after_the_grace() -> None:
    # 4 replicas, then 2 from t=300: the spot node's replicas stop (the on-demand base stays) and the
    # node, empty, is released 120 s later (the planner's empty_node_grace_s).
    class Shrink(StaticPolicy):
        def decide(self, state, obs, now):  # type: ignore[no-untyped-def]
            state, decision = super().decide(state, obs, now)
            return state, replace(decision, desired=4 if now < 300 else 2)

    result = simulate(_steady(600), _planned_fleet(4), Shrink(4, tick_s=1.0))
    on_demand_s, spot_s = 659, 300 + 120
    assert result.cost_usd == pytest.approx((49.24 * on_demand_s + 31.50 * spot_s) / 3600, rel=0.01)


def test_failed_starts_are_replayed_with_the_live_back_off() -> None:
    # Half the replica starts fail at the end of the 90 s load (seeded). The live decision retires each, cleans
    # it up and backs the model's starts off (5 s doubling), exactly as the loop does: the fleet still reaches its
    # 4 replicas, with more starts than replicas, and every request is served in the end.
    scenario = Scenario(start_failure_rate=0.5, seed=1)
    result = simulate(_steady(900), _planned_fleet(0), StaticPolicy(4, tick_s=1.0), scenario)
    assert result.cold_starts > 4
    assert result.timeline[-1].ready == 4
    assert all(not math.isnan(t) for t in result.ttft_s)
