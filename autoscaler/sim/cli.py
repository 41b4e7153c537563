"""`kvgate sim` / `python -m kvgate.autoscaler.sim`: replay a trace against kvgate's scaler and the baselines.

    kvgate sim --trace ../shared/traces/azure_llm_2023_conv.csv --registry examples/sim \\
        --model chat-70b --rate-scale 10 --json out.json --plot out.png
    kvgate sim --bursty --registry examples/sim --model burst-8b

Prints the comparison table; exits 2 with one line on stderr for a bad file, registry or option.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from kvgate.autoscaler.argtypes import positive_float
from kvgate.autoscaler.sim.compare import POLICIES, run_comparison
from kvgate.autoscaler.sim.records import Scenario, Stockout
from kvgate.autoscaler.sim.report import table, write_json, write_plot
from kvgate.autoscaler.sim.service import SimConfigError
from kvgate.autoscaler.sim.shapes import SHAPES, ShapeSpec, shaped_trace
from kvgate.autoscaler.sim.traces import BurstySpec, TraceError, bursty_trace, compress_time, load_trace, scale_rate
from kvgate.registry import RegistryInvalid, UnknownName, load_registry

EPILOG = """\
Traces: an Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or a Mooncake JSONL
(timestamp ms, input_length, output_length), or --bursty for a synthetic trace of idle gaps and 10x spikes,
or --shape for one of the synthetic shapes (mmpp, diurnal, prefill-heavy, decode-heavy, ramp, flash-crowd).
The service model (prefill/decode tokens per second, batch per GPU kind) and cold starts (pool
node_boot_s + model performance.model_load_s) come from the registry; see examples/sim.
Policies: kvgate (autoscaler.scaler.decide_replicas), kpa (Knative defaults), ray-serve (Ray Serve
defaults), llm-d (the workload-variant autoscaler's saturation rule), dynamo (Dynamo's SLA planner, constant
predictor), static-peak, oracle (perfect foresight, searched for the cheapest schedule meeting 99%). Every
policy is the replica step of the live loop's own decision (autoscaler.decide): its replicas are drained,
backed off and placed on nodes by the live planner, and whole nodes are charged. "vs bound": GPU-hours over
the lower bound (an LP over the whole trace) that no schedule meeting 99% goes under; "-" where no schedule
within the fleet's limits meets 99% (the line above the table says why). "vs node plan": dollars over the
cheapest node plan that holds the same replicas over time (it knows the demand and the stockouts ahead).
"""


def _stockout(text: str) -> Stockout:
    parts = text.rsplit(":", 2)
    try:
        return Stockout(parts[0], float(parts[1]), float(parts[2]))
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write POOL/INSTANCE_TYPE/CAPACITY:START_S:END_S, e.g. aws-us-east-1/p5.48xlarge/spot:600:1800"
        ) from None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a share from 0 up to (not including) 1, e.g. 0.2")
    return value


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=VALUE, e.g. scale_down_delay_s=60")
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate sim", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay a request trace on a fake clock against kvgate's replica scaler and baselines "
                    "(Knative KPA, Ray Serve, static at peak, an oracle) and compare SLO attainment and cost.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="an Azure .csv or Mooncake .jsonl trace")
    source.add_argument("--bursty", action="store_true", help="a synthetic trace: idle gaps and 10x spikes")
    source.add_argument("--shape", choices=SHAPES, metavar="NAME",
                        help=f"a synthetic trace of one shape: {', '.join(SHAPES)} (autoscaler/sim/shapes.py)")
    parser.add_argument("--registry", required=True, metavar="DIR", help="registry with the model and its pools")
    parser.add_argument("--model", help="the Model to simulate (default: the only one, else required)")
    parser.add_argument("--policy", action="append", choices=POLICIES, metavar="NAME",
                        help=f"policy to run, repeatable (default: all of {', '.join(POLICIES)})")
    parser.add_argument("--rate-scale", type=positive_float, default=1.0,
                        help="multiply the arrival rate on the same timeline (default: 1)")
    parser.add_argument("--time-compress", type=positive_float, default=1.0,
                        help="play the trace this many times faster (default: 1)")
    parser.add_argument("--duration-s", type=positive_float, help="replay only the first this-many seconds")
    parser.add_argument("--bursty-base-rps", type=positive_float, default=BurstySpec.base_rps,
                        help="--bursty: quiet-phase rate (default: %(default)s)")
    parser.add_argument("--shape-mean-rps", type=positive_float, default=ShapeSpec.mean_rps,
                        help="--shape: the mean arrival rate over the trace, before --rate-scale (default: "
                             "%(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for rate scaling, --bursty, --shape and spot (default: 0)")
    parser.add_argument("--warmup-s", type=float, default=600.0,
                        help="seconds of mirrored trace played unscored first (default: %(default)s)")
    parser.add_argument("--spot-interruptions-per-hour", type=float, default=0.0,
                        help="interruption rate of each spot replica, or of each spot node for kvgate, whose nodes "
                             "come from the live planner (default: 0)")
    parser.add_argument("--sweep", action="store_true",
                        help="also run each baseline (kpa, ray-serve, llm-d, dynamo) at the setting of its knob "
                             "(target, KV threshold, throughput headroom) that meets 99%% most cheaply, found by "
                             "bisection: the comparison at equal attainment (several runs per baseline)")
    parser.add_argument("--start-failure-rate", type=_share, default=0.0, metavar="SHARE",
                        help="share of replica starts that fail at the end of the model load (an engine that "
                             "crashes on load): the autoscaler backs the model's starts off, 5 s doubling to 300 s, "
                             "as it does live (default: 0)")
    parser.add_argument("--stockout", action="append", type=_stockout, default=[], metavar="KEY:START:END",
                        help="placements whose key starts with KEY sell nothing in [START, END) s; repeatable")
    parser.add_argument("--kvgate-set", action="append", type=_setting, default=[], metavar="KEY=VALUE",
                        help="override one of the model's scaling knobs for the kvgate policy only, e.g. "
                             "scale_down_delay_s=60 or forecast_enabled=true; repeatable")
    parser.add_argument("--json", metavar="OUT", help="write summaries and timelines as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG of demand vs replicas over time")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        snapshot = load_registry(args.registry)
        model = args.model
        if model is None:
            if len(snapshot.models) != 1:
                raise SimConfigError(f"the registry has {len(snapshot.models)} models; pick one with --model "
                                     f"({', '.join(sorted(snapshot.models))})")
            model = next(iter(snapshot.models))
        snapshot.model(model)
        if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the long part, not after it
            raise SimConfigError("--plot needs matplotlib: pip install 'kvgate[sim]'")
        for out in (args.json, args.plot):  # fail before the long part, not after it
            if out and not Path(out).resolve().parent.is_dir():
                raise SimConfigError(f"{out}: no such directory {str(Path(out).parent)!r} to write into")
        if args.bursty:
            trace = bursty_trace(BurstySpec(base_rps=args.bursty_base_rps, seed=args.seed))
        elif args.shape:
            trace = shaped_trace(args.shape, ShapeSpec(mean_rps=args.shape_mean_rps, seed=args.seed))
        else:
            trace = load_trace(args.trace)
        if args.duration_s:
            trace = trace.slice(0.0, args.duration_s)
        trace = compress_time(trace, args.time_compress) if args.time_compress != 1 else trace
        trace = scale_rate(trace, args.rate_scale, seed=args.seed)
        if not trace.requests:
            raise TraceError("the trace has no requests (after --duration-s)")
        scenario = Scenario(spot_interruptions_per_hour=args.spot_interruptions_per_hour, stockouts=tuple(args.stockout),
                            start_failure_rate=args.start_failure_rate, seed=args.seed)
        started = time.perf_counter()
        comparison = run_comparison(trace, snapshot, model, policies=args.policy or POLICIES, sweep=args.sweep,
                                    scenario=scenario, warmup_s=max(0.0, args.warmup_s),
                                    kvgate_scaling=dict(args.kvgate_set))
        elapsed = time.perf_counter() - started
    except (RegistryInvalid, TraceError, SimConfigError, UnknownName, OSError) as error:
        print(f"kvgate sim: {error}", file=sys.stderr)
        return 2
    print(table(comparison))
    print(f"\nsimulated {trace.duration_s / 60:.1f} min x {len(comparison.results)} policies "
          f"(+ oracle search) in {elapsed:.1f}s")
    try:
        if args.json:
            write_json(comparison, args.json)
            print(f"wrote {Path(args.json)}")
        if args.plot:
            write_plot(comparison, args.plot)
            print(f"wrote {Path(args.plot)}")
    except OSError as error:  # e.g. a read-only directory
        print(f"kvgate sim: cannot write {error.filename or 'the output'}: {error.strerror or error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
