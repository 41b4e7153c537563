"""The oracle's search (`autoscaler/sim/oracle.py`): the refinement's worked steps, and on a real trace slice a
refined schedule that still meets the goal, costs no more than the family's best and never less than the bound."""

from __future__ import annotations

from pathlib import Path

from kvgate.autoscaler.sim.bound import gpu_hours_lower_bound
from kvgate.autoscaler.sim.compare import Bench
from kvgate.autoscaler.sim.baselines import oracle_need
from kvgate.autoscaler.sim.oracle import REFINE_BLOCK_S, _Blocks, refine, try_need
from kvgate.autoscaler.sim.traces import load_trace, scale_rate
from kvgate.registry import load_registry

REPO = Path(__file__).resolve().parents[2]
AZURE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
EXAMPLES = REPO / "examples" / "sim"


def test_a_cut_takes_replicas_from_its_block_only_and_leaves_the_warm_up() -> None:
    blocks = _Blocks(count=2, of_request=(0, 1), start_s=2.0)
    need = (4, 4) + (10,) * int(REFINE_BLOCK_S) + (1,) * int(REFINE_BLOCK_S) + (0, 3)
    cut = blocks.cut(need, [2, 1])
    assert cut[:2] == (4, 4)  # warm-up untouched
    assert cut[2] == 8 and cut[2 + int(REFINE_BLOCK_S) - 1] == 8  # 10 less the first block's 2
    assert cut[2 + int(REFINE_BLOCK_S)] == 1  # 1 less 1 would be none: a second that needs one keeps one
    assert cut[-2:] == (0, 2)  # the tail past the last block is the last block's; nothing stays nothing


def test_the_refinement_spends_spare_misses_and_stays_above_the_bound() -> None:
    # 15 minutes of the Azure trace at 10x its rate (three blocks), from a curve with misses to spare: 70% of a
    # replica on the 30 s mean meets the goal with room (the search's own pick sits at the goal's edge).
    trace = scale_rate(load_trace(AZURE).slice(0, 900), 10.0)
    bench = Bench.of(trace, load_registry(EXAMPLES), "chat-70b", warmup_s=120)
    start = try_need(bench, oracle_need(bench.trace, bench.base.placements[0].service, 0.7, window_s=30,
                                        tail_s=bench.base.tail_s), "70%")
    assert start.attainment > 0.999
    refined = refine(bench, start)
    assert refined.attainment >= 0.99
    assert refined.result.gpu_seconds < start.result.gpu_seconds
    assert "blocks of 300 s cut by" in refined.rule
    base = bench.base
    bound = gpu_hours_lower_bound(trace, base.placements, slo_s=base.ttft_slo_s, goal=refined.attainment,
                                  max_replicas=base.max_replicas, tail_s=base.tail_s)
    assert bound.feasible and bound.gpu_hours <= refined.result.gpu_seconds / 3600


def test_a_curve_at_a_higher_utilization_never_needs_more_replicas() -> None:
    # The need and its decode slowdown depend on each other (`oracle_need`). Two plain rounds of need-then-slowdown
    # overshot the more, the higher the utilization: Azure x10 asked 53 replicas at 100% and 36 at 76%, and the
    # search kept the dearest passing curve. At the fixed point a higher utilization needs no more. Minutes 25-35 of
    # the trace at 10x: the two rounds asked 14,145 replica-seconds at 76% and 20,635 at 100% (at most 37 replicas and
    # 51); the fixed point 10,326 and 9,006 (28 and 25).
    trace = scale_rate(load_trace(AZURE).slice(1500, 2100), 10.0)
    service = Bench.of(trace, load_registry(EXAMPLES), "chat-70b", warmup_s=0).base.placements[0].service
    for window_s in (0, 60):
        curves = [oracle_need(trace, service, u, window_s=window_s) for u in (0.6, 0.76, 0.9, 1.0)]
        sums = [sum(curve) for curve in curves]  # replica-seconds: what the curve costs
        assert sums == sorted(sums, reverse=True) and sums[-1] < sums[0]
        # A peak second can still move by a replica or two either way (the seconds' holds overlap), never up by 14.
        assert max(curves[-1]) <= max(curves[0])
