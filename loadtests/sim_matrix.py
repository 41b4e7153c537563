"""Every autoscaling policy over every trace and synthetic shape, at several rate scales: issue 28's results table.

For each (trace or shape, rate scale) it runs `kvgate sim`'s comparison (`autoscaler/sim/compare.py`: every policy
placed and charged per node by the live planner, the oracle searched, the lower bound solved) with one set of
defaults, the registry's, and prints one Markdown row per policy: TTFT-SLO attainment, GPU-hours, dollars, the
ratios to the oracle and to the lower bound ("-" where that yardstick misses 99%, with the reason in the JSON), and
the dollars over the cheapest node plan holding the same replicas (`autoscaler/sim/nodeplan.py`).

    .venv/bin/python loadtests/sim_matrix.py                                  # everything: long (tens of minutes)
    .venv/bin/python loadtests/sim_matrix.py --sources azure,mmpp --scales 1,5 --duration-s 1800
    .venv/bin/python loadtests/sim_matrix.py --spot-interruptions-per-hour 1 --stockout-cheapest   # the world churns

Traces: `azure` (../shared/traces/azure_llm_2023_conv.csv, chat-70b), `mooncake` (the Mooncake conversation trace,
chat-70b), and the shapes of `autoscaler/sim/shapes.py` (burst-8b; a mean of 4 requests/s at scale 1). Writes
loadtests/.work/sim_matrix.json. Seeded and simulated: the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgate.autoscaler.sim.compare import ATTAINMENT_GOAL, POLICIES, build_fleet, run_comparison  # noqa: E402
from kvgate.autoscaler.sim.records import Scenario, Stockout  # noqa: E402
from kvgate.autoscaler.sim.report import yardsticks  # noqa: E402
from kvgate.autoscaler.sim.shapes import SHAPES, ShapeSpec, shaped_trace  # noqa: E402
from kvgate.autoscaler.sim.traces import Trace, load_trace, scale_rate  # noqa: E402
from kvgate.registry import load_registry  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
FILES = {"azure": TRACES / "azure_llm_2023_conv.csv", "mooncake": TRACES / "mooncake_fast25_conversation_trace.jsonl"}
SOURCES = (*FILES, *SHAPES)


def source_trace(name: str, scale: float, duration_s: float | None) -> tuple[Trace, str]:
    """The trace of `name` at `scale` and the example model it is judged on.

    A recorded trace is scaled by copying each request (`traces.scale_rate`: copies within 50 ms, so the same
    bursts, each `scale` times over); a shape is drawn at `scale` times its mean rate, every request independent.
    """
    if name in FILES:
        trace = load_trace(FILES[name])
        return scale_rate(trace.slice(0, duration_s) if duration_s else trace, scale), "chat-70b"
    return shaped_trace(name, ShapeSpec(duration_s=duration_s or 3600.0, mean_rps=4.0 * scale)), "burst-8b"


WARMUP_S = 600.0  # run_comparison's default: unscored, mirrored trace before each run


def scenario_for(snapshot, model: str, trace: Trace, args: argparse.Namespace) -> Scenario:
    """The world's churn asked for: spot interruptions, and with --stockout-cheapest the model's cheapest placement
    selling nothing for the middle third of the scored run (times in the simulator's clock, after the warm-up)."""
    stockouts = ()
    if args.stockout_cheapest:
        cheapest = build_fleet(snapshot, model).placements[0].key
        third = trace.duration_s / 3
        stockouts = (Stockout(cheapest, WARMUP_S + third, WARMUP_S + 2 * third),)
    return Scenario(spot_interruptions_per_hour=args.spot_interruptions_per_hour, stockouts=stockouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    parser.add_argument("--scales", default="1,5,10,20", help="rate scales, comma-separated")
    parser.add_argument("--duration-s", type=float, help="the first this-many seconds of each trace (shapes: length)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of " + ", ".join(POLICIES))
    parser.add_argument("--kvgate-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the model's spec.scaling for kvgate alone (as kvgate sim's); repeatable")
    parser.add_argument("--sweep", action="store_true",
                        help="also each baseline at the knob setting meeting 99%% most cheaply (kvgate sim --sweep)")
    parser.add_argument("--spot-interruptions-per-hour", type=float, default=0.0,
                        help="interruptions per spot node-hour (seeded; default 0)")
    parser.add_argument("--stockout-cheapest", action="store_true",
                        help="the model's cheapest placement sells nothing for the middle third of each run")
    parser.add_argument("--out", default=str(ROOT / "loadtests" / ".work" / "sim_matrix.json"))
    args = parser.parse_args()
    sources = args.sources.split(",")
    unknown = set(sources) - set(SOURCES)
    if unknown:
        parser.error(f"unknown source(s) {', '.join(sorted(unknown))}; choose from {', '.join(SOURCES)}")
    snapshot = load_registry(ROOT / "examples" / "sim")
    overrides = {}
    for item in args.kvgate_set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--kvgate-set {item!r}: expected KEY=VALUE")
        overrides[key] = json.loads(value) if value not in ("true", "false") else value == "true"

    rows = []
    print("| trace | scale | policy | TTFT-SLO | GPU-h | USD | vs oracle | vs bound | vs node plan |\n"
          "|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in sources:
        for scale in (float(x) for x in args.scales.split(",")):
            started = time.perf_counter()
            trace, model = source_trace(name, scale, args.duration_s)
            comparison = run_comparison(trace, snapshot, model, policies=args.policies.split(","),
                                        kvgate_scaling=overrides, scenario=scenario_for(snapshot, model, trace, args),
                                        sweep=args.sweep,
                                        warmup_s=WARMUP_S)
            oracle_hours, bound_hours = yardsticks(comparison)
            for s in comparison.summaries:
                row = {"trace": name, "model": model, "scale": scale, "policy": s.policy,
                       "attainment": s.slo_attainment, "gpu_hours": s.gpu_hours, "cost_usd": s.cost_usd,
                       "vs_oracle": s.gpu_hours / oracle_hours if oracle_hours else None,
                       "vs_bound": s.gpu_hours / bound_hours if bound_hours else None,
                       "node_plan_usd": s.node_plan_usd,
                       "vs_node_plan": s.cost_usd / s.node_plan_usd if s.node_plan_usd else None,
                       "bound": {"feasible": comparison.bound.feasible, "gpu_hours": bound_hours,
                                 "reason": comparison.bound.reason},
                       "oracle_rule": comparison.oracle_rule}
                rows.append(row)
                ratios = [f"{r:.2f}x" if r else "-" for r in (row["vs_oracle"], row["vs_bound"], row["vs_node_plan"])]
                print(f"| {name} | {scale:g} | {s.policy} | {s.slo_attainment:.2%} | {s.gpu_hours:.1f} | "
                      f"{s.cost_usd:,.0f} | {ratios[0]} | {ratios[1]} | {ratios[2]} |", flush=True)
            print(f"  ({name} x{scale:g}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    write_rows(Path(args.out), rows)


def write_rows(out: Path, rows: list[dict]) -> None:
    """The JSON both sim scripts write: the goal and one row per result."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"goal": ATTAINMENT_GOAL, "rows": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
