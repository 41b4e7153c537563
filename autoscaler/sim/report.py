"""The comparison as a table (text), as JSON, and as a PNG of demand vs replicas over time.

Formatting is pure (`table`, `to_json`); `write_plot` is the one function that writes a file, with
matplotlib imported inside it on the Agg backend (no display needed, and `kvgate sim` without --plot
never imports it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvgate.autoscaler.sim.compare import ATTAINMENT_GOAL, Comparison, Summary

COLUMNS = ("policy", "TTFT-SLO", "p50 TTFT", "p99 TTFT", "GPU-h", "vs oracle", "vs bound", "USD", "vs node plan",
           "cold starts", "actions/h", "peak")


def _seconds(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.2f}s"


def _ratio(value: float, against: float | None) -> str:
    return f"{value / against:.2f}x" if against else "-"


def yardsticks(comparison: Comparison) -> tuple[float | None, float | None]:
    """The GPU-hours of the oracle and of the lower bound, each None where it does not meet the goal (no
    ratio against a schedule that misses the SLO says anything)."""
    oracle = next((s for s in comparison.summaries if s.policy == "oracle"), None)
    met = oracle is not None and oracle.slo_attainment >= ATTAINMENT_GOAL and oracle.gpu_hours > 0
    oracle_hours = oracle.gpu_hours if met else None
    bound = comparison.bound
    return oracle_hours, (bound.gpu_hours if bound.feasible and bound.gpu_hours > 0 else None)


def rows(comparison: Comparison) -> list[tuple[str, ...]]:
    oracle_hours, bound_hours = yardsticks(comparison)
    return [(s.policy, f"{s.slo_attainment * 100:.2f}%", _seconds(s.ttft_p50_s), _seconds(s.ttft_p99_s),
             f"{s.gpu_hours:.1f}", _ratio(s.gpu_hours, oracle_hours), _ratio(s.gpu_hours, bound_hours),
             f"{s.cost_usd:,.0f}", _ratio(s.cost_usd, s.node_plan_usd or None), str(s.cold_starts),
             f"{s.scaling_actions_per_hour:.1f}", str(s.max_replicas))
            for s in comparison.summaries]


def bound_line(comparison: Comparison) -> str:
    """What the lower bound says: the least GPU-hours of any schedule meeting the goal, or why none does."""
    bound = comparison.bound
    if not bound.feasible:
        return f"lower bound: {bound.reason}; no ratio is given against it or a schedule missing it"
    return (f"lower bound: no schedule meeting {bound.goal:.0%} spends under {bound.gpu_hours:.1f} GPU-h "
            f"(${bound.cost_usd:,.0f})")


def table(comparison: Comparison) -> str:
    """A Markdown table (it reads as plain text too), headed by what was run."""
    body = [COLUMNS, *rows(comparison)]
    widths = [max(len(row[i]) for row in body) for i in range(len(COLUMNS))]

    def line(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    first = comparison.summaries[0] if comparison.summaries else None
    head = (f"trace {comparison.trace}, model {comparison.model}, {first.num_requests if first else 0} requests, "
            f"cold start {comparison.cold_start_s:g}s; oracle: {comparison.oracle_rule}")
    return "\n".join([head, bound_line(comparison), "", line(COLUMNS), rule, *(line(r) for r in body[1:])])


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def to_json(comparison: Comparison) -> dict[str, Any]:
    """The summaries plus each policy's timeline (every tick: t, arrivals/s, ongoing, ready, desired)."""
    def summary(s: Summary) -> dict[str, Any]:
        data = asdict(s)
        data["ttft_p50_s"], data["ttft_p99_s"] = _finite(s.ttft_p50_s), _finite(s.ttft_p99_s)
        return data

    return {
        "trace": comparison.trace, "model": comparison.model, "cold_start_s": comparison.cold_start_s,
        "oracle_rule": comparison.oracle_rule,
        "lower_bound": {"goal": comparison.bound.goal, "feasible": comparison.bound.feasible,
                        "gpu_hours": _finite(comparison.bound.gpu_hours), "cost_usd": _finite(comparison.bound.cost_usd),
                        "reason": comparison.bound.reason},
        "policies": [summary(s) for s in comparison.summaries],
        "timelines": {r.policy: [[p.t, round(p.arrivals_per_s, 3), p.ongoing, p.ready, p.active, p.desired]
                                 for p in r.timeline] for r in comparison.results},
        "timeline_columns": ["t_s", "arrivals_per_s", "ongoing", "ready", "active", "desired"],
    }


def write_json(comparison: Comparison, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(comparison), indent=1) + "\n")


def write_plot(comparison: Comparison, path: str | Path) -> None:
    """Demand (ongoing requests / target, in replicas) and each policy's ready replicas over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=(1, 2))
    first = comparison.results[0]
    minutes = [p.t / 60 for p in first.timeline]
    top.plot(minutes, [p.arrivals_per_s for p in first.timeline], color="black", linewidth=0.8)
    top.set_ylabel("arrivals / s")
    top.set_title(f"{comparison.trace}: {comparison.model}")
    for result in comparison.results:
        bottom.step([p.t / 60 for p in result.timeline], [p.ready for p in result.timeline],
                    where="post", linewidth=1.0, label=result.policy)
    bottom.set_xlabel("minutes")
    bottom.set_ylabel("ready replicas")
    bottom.legend(loc="upper left", ncol=len(comparison.results), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
