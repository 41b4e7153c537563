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

from kvgate.autoscaler.sim.compare import Comparison, Summary

COLUMNS = ("policy", "TTFT-SLO", "p50 TTFT", "p99 TTFT", "GPU-h", "vs oracle", "USD", "cold starts",
           "actions/h", "peak")


def _seconds(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.2f}s"


def rows(comparison: Comparison) -> list[tuple[str, ...]]:
    oracle = next((s for s in comparison.summaries if s.policy == "oracle"), None)
    out = []
    for s in comparison.summaries:
        ratio = f"{s.gpu_hours / oracle.gpu_hours:.2f}x" if oracle and oracle.gpu_hours > 0 else "-"
        out.append((s.policy, f"{s.slo_attainment * 100:.2f}%", _seconds(s.ttft_p50_s), _seconds(s.ttft_p99_s),
                    f"{s.gpu_hours:.1f}", ratio, f"{s.cost_usd:,.0f}", str(s.cold_starts),
                    f"{s.scaling_actions_per_hour:.1f}", str(s.max_replicas)))
    return out


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
    return "\n".join([head, "", line(COLUMNS), rule, *(line(r) for r in body[1:])])


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
