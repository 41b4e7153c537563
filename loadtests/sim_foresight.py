"""What knowing the future is worth: the oracle's need curves run with and without their look-ahead.

The oracle orders each second's replicas one cold start ahead. Run the same need curves ordering them only when
the second comes (a policy that knows the present load exactly, and nothing of what is coming), and the search
(`autoscaler/sim/oracle.py`: each curve's highest utilization meeting 99%) says what any reactive policy needs to
reach the goal on that trace: the GPU-hours of the cheapest present-only schedule, or, where none reaches 99% even
at half a replica's batch, the best attainment one did. Where that misses, so must every policy that reacts to
load, kvgate included; where it meets the goal, its GPU-hours are what reacting costs over foreseeing.

    .venv/bin/python loadtests/sim_foresight.py --cells azure:20,diurnal:10,ramp:10,prefill-heavy:1 --duration-s 1800

Writes loadtests/.work/sim_foresight.json. Seeded and simulated: the same on any machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "loadtests"))

from kvgate.autoscaler.sim.compare import Bench  # noqa: E402
from kvgate.autoscaler.sim.oracle import WINDOWS_S, OracleTry, bisect_utilization  # noqa: E402
from kvgate.registry import load_registry  # noqa: E402
from sim_matrix import SOURCES, WARMUP_S, source_trace, write_rows  # noqa: E402


def cheapest(bench: Bench, look_ahead_s: float | None) -> tuple[OracleTry | None, OracleTry | None]:
    """The cheapest try meeting the goal over every curve, and the best-attaining one that did not."""
    passing: OracleTry | None = None
    failing: OracleTry | None = None
    for window_s in WINDOWS_S:
        ok, short = bisect_utilization(bench, window_s, look_ahead_s=look_ahead_s)
        if ok and (passing is None or ok.result.gpu_seconds < passing.result.gpu_seconds):
            passing = ok
        if short and (failing is None or short.attainment > failing.attainment):
            failing = short
    return passing, failing


def describe(passing: OracleTry | None, failing: OracleTry | None) -> dict:
    if passing is not None:
        return {"meets_goal": True, "attainment": passing.attainment,
                "gpu_hours": passing.result.gpu_seconds / 3600, "rule": passing.rule}
    assert failing is not None
    return {"meets_goal": False, "attainment": failing.attainment,
            "gpu_hours": failing.result.gpu_seconds / 3600, "rule": failing.rule}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", required=True, help="comma-separated SOURCE:SCALE, e.g. azure:20,ramp:10")
    parser.add_argument("--duration-s", type=float, default=1800.0, help="the first this-many seconds of each trace")
    parser.add_argument("--out", default=str(ROOT / "loadtests" / ".work" / "sim_foresight.json"))
    args = parser.parse_args()
    cells = []
    for item in args.cells.split(","):
        name, sep, scale = item.partition(":")
        if not sep or name not in SOURCES:
            parser.error(f"--cells {item!r}: expected SOURCE:SCALE with SOURCE one of {', '.join(SOURCES)}")
        cells.append((name, float(scale)))
    snapshot = load_registry(ROOT / "examples" / "sim")
    rows = []
    print("| trace | foresight (one cold start ahead) | present only |\n|---|---|---|")
    for name, scale in cells:
        started = time.perf_counter()
        trace, model = source_trace(name, scale, args.duration_s)
        bench = Bench.of(trace, snapshot, model, warmup_s=WARMUP_S)
        row = {"trace": name, "scale": scale, "model": model, "cold_start_s": bench.cold_start_s,
               "foresight": describe(*cheapest(bench, None)), "present_only": describe(*cheapest(bench, 0.0))}
        rows.append(row)
        cells_text = [f"{'' if r['meets_goal'] else 'best '}{r['attainment']:.2%}, {r['gpu_hours']:.1f} GPU-h"
                      for r in (row["foresight"], row["present_only"])]
        print(f"| {name} x{scale:g} | {cells_text[0]} | {cells_text[1]} |", flush=True)
        print(f"  ({name} x{scale:g}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    write_rows(Path(args.out), rows)


if __name__ == "__main__":
    main()
