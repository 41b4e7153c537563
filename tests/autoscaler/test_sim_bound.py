"""The simulator's lower bound on GPU-hours (`autoscaler/sim/bound.py`): worked numbers, the limits that make a
goal unreachable, and no policy (the oracle included) ever below it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.autoscaler.sim.bound import gpu_hours_lower_bound
from kvgate.autoscaler.sim.compare import build_fleet, run_comparison
from kvgate.autoscaler.sim.service import Placement, ServiceModel
from kvgate.autoscaler.sim.traces import Request, Trace, load_trace, scale_rate
from kvgate.registry import load_registry
from kvgate.registry.schema import CapacityType

REPO = Path(__file__).resolve().parents[2]
AZURE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
EXAMPLES = REPO / "examples" / "sim"


def placement(prefill_tokens_per_s: float = 1000.0, decode_tokens_per_s: float = 800.0, max_batch: int = 8,
              gpus: int = 1, price: float = 2.0) -> Placement:
    service = ServiceModel("h100", prefill_tokens_per_s, decode_tokens_per_s, max_batch)
    return Placement("pool", "node", CapacityType.ON_DEMAND, price, gpus, 60.0, service)


def steady(n: int, input_tokens: int, output_tokens: int, every_s: float = 1.0) -> Trace:
    return Trace("steady", tuple(Request(i * every_s, input_tokens, output_tokens) for i in range(n)))


def test_a_prefill_bound_load_needs_its_prefill_time() -> None:
    # 100 requests a second apart, each 1,000 prompt tokens at 1,000 tokens/s: 100 s of prefill, on 1 GPU.
    # The decode is small (1 token: no decode at all), so slots bind nothing; the bound is about 100 GPU-s.
    bound = gpu_hours_lower_bound(steady(100, 1000, 1), [placement()], slo_s=2.0, goal=1.0, max_replicas=4,
                                  tail_s=0.0)
    assert bound.feasible
    assert 90.0 <= bound.gpu_hours * 3600 <= 100.0 + 1e-6
    assert bound.cost_usd == pytest.approx(bound.gpu_hours * 2.0)


def test_a_decode_bound_load_needs_its_slot_time() -> None:
    # Prefill is instant (1 token); each request decodes 800 tokens at 800/8 = 100 a second a slot: 8 s in a
    # slot of 8, 1 GPU-s each, 100 of them: about 100 GPU-s, less what falls past the run's end.
    bound = gpu_hours_lower_bound(steady(100, 1, 801), [placement(prefill_tokens_per_s=1e9)], slo_s=2.0, goal=1.0,
                                  max_replicas=4, tail_s=60.0)
    assert 90.0 <= bound.gpu_hours * 3600 <= 100.0 + 1e-6


def test_meeting_fewer_requests_can_only_cost_less() -> None:
    trace = steady(200, 2000, 50, every_s=0.5)
    at = {goal: gpu_hours_lower_bound(trace, [placement()], slo_s=3.0, goal=goal, max_replicas=8, tail_s=30.0)
          for goal in (0.5, 0.9, 0.99)}
    assert at[0.5].gpu_hours < at[0.9].gpu_hours < at[0.99].gpu_hours


def test_a_goal_out_of_reach_is_said_with_why_and_no_number() -> None:
    # 1.5 s prefills every 0.5 s, 3 s of prefill a second, on at most 2 one-GPU replicas: no schedule keeps up.
    capped = gpu_hours_lower_bound(steady(100, 1500, 1, every_s=0.5), [placement()], slo_s=2.0, goal=0.99,
                                   max_replicas=2, tail_s=0.0)
    assert not capped.feasible and "max_replicas" in capped.reason and capped.gpu_hours != capped.gpu_hours
    # A prompt whose prefill alone takes 5 s never meets a 2 s SLO, whatever the fleet.
    slow = gpu_hours_lower_bound(steady(10, 5000, 1), [placement()], slo_s=2.0, goal=0.5, max_replicas=100,
                                 tail_s=0.0)
    assert not slow.feasible and "longer than the 2 s SLO to prefill" in slow.reason


def test_the_cheapest_placement_per_token_is_what_the_bound_charges() -> None:
    # A 2-GPU placement twice as fast costs the same GPU-seconds a token as the 1-GPU one; a 1-GPU one twice
    # as fast halves them, and the bound takes it.
    trace = steady(100, 1000, 1)
    one = gpu_hours_lower_bound(trace, [placement()], slo_s=2.0, goal=1.0, max_replicas=4, tail_s=0.0)
    both = gpu_hours_lower_bound(trace, [placement(), placement(prefill_tokens_per_s=2000.0, gpus=2)], slo_s=2.0,
                                 goal=1.0, max_replicas=4, tail_s=0.0)
    faster = gpu_hours_lower_bound(trace, [placement(), placement(prefill_tokens_per_s=2000.0)], slo_s=2.0,
                                   goal=1.0, max_replicas=4, tail_s=0.0)
    assert both.gpu_hours == pytest.approx(one.gpu_hours, rel=1e-6)
    assert faster.gpu_hours == pytest.approx(one.gpu_hours / 2, rel=1e-6)


@pytest.mark.parametrize("model", ["chat-70b", "burst-8b"])
def test_no_policy_spends_fewer_gpu_hours_than_the_bound_at_its_own_attainment(model: str) -> None:
    # 5 minutes of the Azure trace at 10x its rate, every policy (the oracle's search included), each held to
    # the bound at the attainment it reached.
    trace = scale_rate(load_trace(AZURE).slice(0, 300), 10.0)
    snapshot = load_registry(EXAMPLES)
    fleet = build_fleet(snapshot, model)
    comparison = run_comparison(trace, snapshot, model, warmup_s=120)
    for summary in comparison.summaries:
        bound = gpu_hours_lower_bound(trace, fleet.placements, slo_s=fleet.ttft_slo_s, goal=summary.slo_attainment,
                                      max_replicas=fleet.max_replicas, tail_s=fleet.tail_s)
        assert bound.feasible, (summary.policy, bound.reason)
        assert bound.gpu_hours <= summary.gpu_hours, (summary.policy, bound.gpu_hours, summary.gpu_hours)
        assert bound.gpu_hours > 0 or summary.slo_attainment == 0  # Dynamo's default meets nothing here: bound 0
