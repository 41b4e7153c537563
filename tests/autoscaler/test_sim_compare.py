"""`kvgate sim` end to end on small slices of the real Azure trace and the bursty generator.

The trace is the verbatim Azure LLM 2023 conversation trace in ../shared/traces (read, not copied);
slices keep each test to a few seconds. The CLI runs as a real subprocess, as a user would run it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.autoscaler.sim.compare import run_comparison
from kvgate.autoscaler.sim.report import table
from kvgate.autoscaler.sim.traces import BurstySpec, bursty_trace, load_trace, scale_rate
from kvgate.registry import load_registry

REPO = Path(__file__).resolve().parents[2]
AZURE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
EXAMPLES = REPO / "examples" / "sim"


@pytest.fixture(scope="module")
def azure_slice_comparison():
    # 5 minutes at 10x the rate (about 530 requests a minute), 2 minutes of mirrored warm-up.
    trace = scale_rate(load_trace(AZURE).slice(0, 300), 10.0)
    return run_comparison(trace, load_registry(EXAMPLES), "chat-70b", warmup_s=120)


def test_every_policy_is_scored_on_the_same_requests(azure_slice_comparison) -> None:
    summaries = {s.policy: s for s in azure_slice_comparison.summaries}
    assert list(summaries) == ["kvgate", "kpa", "ray-serve", "llm-d", "dynamo", "static-peak", "oracle"]
    assert len({s.num_requests for s in summaries.values()}) == 1
    assert summaries["kvgate"].num_requests > 2_000
    # The oracle search keeps a schedule that meets the goal; static at its peak never uses less GPU time.
    assert summaries["oracle"].slo_attainment >= 0.99
    assert summaries["static-peak"].gpu_hours >= summaries["oracle"].gpu_hours
    for s in summaries.values():
        assert 0.0 <= s.slo_attainment <= 1.0 and s.gpu_hours > 0 and s.cost_usd > 0
        assert s.ttft_p50_s <= s.ttft_p99_s
        # The live planner's nodes for the replicas a run placed never cost less than the cheapest plan holding them
        # (no spot interruptions here, so no expected cost in the plan).
        assert 0 < s.node_plan_usd <= s.cost_usd * (1 + 1e-9), s  # equal where the planner did the cheapest


def test_the_sweep_finds_each_baselines_cheapest_setting_meeting_the_goal() -> None:
    # Dynamo's planner at its documented throughputs (headroom 1) runs its fleet full and misses nearly every SLO on
    # this slice; the sweep raises the headroom (1 / 0.9, ... 10) until 99% is met, by bisection.
    trace = scale_rate(load_trace(AZURE).slice(0, 300), 10.0)
    comparison = run_comparison(trace, load_registry(EXAMPLES), "chat-70b", warmup_s=120,
                                policies=("dynamo", "kpa"), sweep=True)
    s = {summary.policy.split(" ")[0] + (" swept" if " " in summary.policy else ""): summary
         for summary in comparison.summaries}
    assert s["dynamo"].slo_attainment < 0.99 <= s["dynamo swept"].slo_attainment
    assert s["dynamo swept"].gpu_hours > s["dynamo"].gpu_hours
    assert s["kpa swept"].slo_attainment >= 0.99
    swept = [summary.policy for summary in comparison.summaries if " " in summary.policy]
    assert swept[0].startswith("dynamo headroom=") and swept[1].startswith("kpa target=")


@pytest.mark.timeout(600)  # the longest test in the suite: four policies and the oracle's search over an hour
def test_issue_targets_hold_on_the_whole_azure_trace_at_ten_times_its_rate() -> None:
    """Issue 28's targets on the full Azure trace at 10x (193,660 requests), as docs/benchmarks.md reports them:
    kvgate reaches >= 99% TTFT-SLO attainment at <= 1.25x the GPU-hours of the best offline schedule the simulator
    finds (the oracle), and against KPA and Ray Serve at their defaults it either spends less or is the one of the
    two meeting 99% (Ray Serve spent 77.5 GPU-h for 98.87% here, kvgate 81.4 for 99.80%). The run is seeded and
    deterministic; about 3.5 minutes on a 2-core box, every replica's engine steps replayed (static-peak left
    out: it bounds nothing here)."""
    trace = scale_rate(load_trace(AZURE), 10.0)
    comparison = run_comparison(trace, load_registry(EXAMPLES), "chat-70b",
                                policies=("kvgate", "kpa", "ray-serve", "oracle"))
    s = {summary.policy: summary for summary in comparison.summaries}
    assert s["kvgate"].num_requests == 193_660
    assert s["oracle"].slo_attainment >= 0.99
    assert s["kvgate"].slo_attainment >= 0.99
    assert s["kvgate"].gpu_hours <= 1.25 * s["oracle"].gpu_hours
    for baseline in ("kpa", "ray-serve"):
        assert s[baseline].slo_attainment < 0.99 or s["kvgate"].gpu_hours < s[baseline].gpu_hours


def test_the_table_names_the_trace_and_each_policy(azure_slice_comparison) -> None:
    text = table(azure_slice_comparison)
    assert "azure_llm_2023_conv" in text and "chat-70b" in text
    for name in ("kvgate", "kpa", "ray-serve", "static-peak", "oracle"):
        assert f"| {name}" in text


def test_scale_to_zero_model_goes_to_zero_in_idle_gaps_and_serves_the_next_spike() -> None:
    trace = bursty_trace(BurstySpec(duration_s=2400, base_rps=2.0, seed=4))
    comparison = run_comparison(trace, load_registry(EXAMPLES), "burst-8b", policies=("kvgate", "oracle"),
                                warmup_s=0)
    kvgate = comparison.results[0]
    readies = [p.ready for p in kvgate.timeline]
    zero_at = readies.index(0)  # burst-8b has min_replicas 0 and a 300 s grace
    assert any(r > 0 for r in readies[zero_at:])  # and comes back for the next requests
    served = [t for t in kvgate.ttft_s if not math.isnan(t)]
    assert len(served) == len(kvgate.ttft_s)  # every request got its first token (held, never dropped)


def test_a_fleet_too_small_for_the_slo_is_said_and_compared_with_nothing(tmp_path: Path) -> None:
    # chat-70b held to 2 replicas: at 10x the Azure trace no schedule meets 99%, the oracle included.
    for name in ("models.yaml", "pools.yaml"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text().replace("max_replicas: 40", "max_replicas: 2"))
    trace = scale_rate(load_trace(AZURE).slice(0, 300), 10.0)
    comparison = run_comparison(trace, load_registry(tmp_path), "chat-70b", policies=("kvgate", "oracle"),
                                warmup_s=60)
    assert not comparison.bound.feasible and "max_replicas" in comparison.bound.reason
    text = table(comparison)
    assert "lower bound: no schedule meets 99.00%: no schedule of at most 2 replicas (max_replicas)" in text
    ratios = [[cell.strip() for cell in row.split("|")[6:8]] for row in text.splitlines() if row.startswith("| ")]
    assert ratios[0] == ["vs oracle", "vs bound"] and ratios[1:] == [["-", "-"], ["-", "-"]]


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.autoscaler.sim", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_cli_prints_the_table_and_writes_json_and_png(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    result = _sim("--trace", str(AZURE), "--registry", str(EXAMPLES), "--model", "chat-70b",
                  "--duration-s", "240", "--rate-scale", "5", "--warmup-s", "60",
                  "--policy", "kvgate", "--policy", "oracle", "--json", str(out_json), "--plot", str(out_png))
    assert result.returncode == 0, result.stderr
    assert "| kvgate" in result.stdout and "| oracle" in result.stdout
    assert "lower bound: no schedule meeting 99% spends under" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["lower_bound"]["feasible"] and data["lower_bound"]["gpu_hours"] > 0
    assert [p["policy"] for p in data["policies"]] == ["kvgate", "oracle"]
    assert len(data["timelines"]["kvgate"]) >= 200  # one point per 1 s tick over 240 s
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["--trace", "/nonexistent.csv", "--model", "chat-70b"], "no such file"),
    (["--bursty", "--model", "nope"], "no model named 'nope'"),
    (["--bursty"], "pick one with --model"),
    (["--bursty", "--model", "burst-8b", "--kvgate-set", "scale_down_delay_s=soon"], "bad kvgate scaling override"),
    (["--bursty", "--model", "burst-8b", "--stockout", "aws/p5:0:60"], "matches none of burst-8b's placements"),
    (["--bursty", "--model", "burst-8b", "--json", "/nonexistent/out.json"], "no such directory '/nonexistent'"),
    (["--bursty", "--model", "burst-8b", "--plot", "/nonexistent/out.png"], "no such directory '/nonexistent'"),
    (["--bursty", "--model", "burst-8b", "--rate-scale", "0"], "--rate-scale: must be > 0"),
    (["--bursty", "--model", "burst-8b", "--start-failure-rate", "1.5"], "a share from 0 up to"),
])
def test_cli_mistakes_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = _sim("--registry", str(EXAMPLES), *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_kvgate_sim_help_is_reachable_from_the_front_door() -> None:
    result = subprocess.run([sys.executable, "-m", "kvgate.cli", "sim", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--rate-scale" in result.stdout and "oracle" in result.stdout
