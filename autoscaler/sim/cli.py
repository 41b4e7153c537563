"""`kvgate sim` / `python -m kvgate.autoscaler.sim`: replay a trace against kvgate's scaler and the baselines.

    kvgate sim --trace ../shared/traces/azure_llm_2023_conv.csv --registry examples/sim \\
        --model chat-70b --rate-scale 10 --json out.json --plot out.png
    kvgate sim --bursty --registry examples/sim --model burst-8b
    kvgate sim --trace ../shared/traces/azure_llm_2023_conv.csv --registry examples/sim \\
        --model chat-70b --rate-scale 10 --shared-slurm 128 --json sharing.json

Prints the comparison table; exits 2 with one line on stderr for a bad file, registry or option.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from kvgate.autoscaler.argtypes import non_negative_float, positive_float
from kvgate.autoscaler.sim.compare import POLICIES, run_comparison
from kvgate.autoscaler.sim.records import Scenario, Stockout
from kvgate.autoscaler.sim.report import table, write_json, write_plot
from kvgate.autoscaler.sim.service import SimConfigError
from kvgate.autoscaler.sim.shapes import SHAPES, ShapeSpec, shaped_trace
from kvgate.autoscaler.sim.sharing import SharingSpec, compare_sharing, sharing_json, sharing_table
from kvgate.autoscaler.sim.training import BacklogSpec
from kvgate.autoscaler.sim.traces import (BurstySpec, Trace, TraceError, bursty_trace, compress_time, load_trace,
                                          scale_rate)
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

--shared-slurm GPUS: kvgate's replica step alone, on one Slurm cluster of GPUS shared with a training backlog
(inference in a high-priority partition, training preemptible with PreemptMode=REQUEUE and a GraceTime) against
two separate clusters of the same total: inference on G_inf GPUs and the backlog on the rest. G_inf is kvgate's
peak on a dedicated cluster unless --inference-gpus sets it. A replica is a Slurm job: its cold start is the model
load; one that needs GPUs training holds waits for the preempted jobs to checkpoint or reach the grace. Columns:
GPU-hours of inference and training, useful training (less graces and work lost to requeues), lent (training
beyond the separate split's training cluster), jobs requeued and completed, utilisation (busy GPU-hours over
GPUs x hours), and starts that waited for training (their mean wait). Rules: autoscaler/sim/training.py.
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


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 0")
    return value


def _gpus(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of GPUs > 0")
    return value


def _gpu_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: GPUs per job, comma-separated whole numbers > 0, e.g. 1,2,4,8")
    return sizes


def _add_sharing_options(parser: argparse.ArgumentParser) -> None:
    """The --shared-slurm options; those after it default to None so that `_sharing_spec` can tell them given."""
    group = parser.add_argument_group("a Slurm cluster shared with training (--shared-slurm; see below)")
    backlog = BacklogSpec()
    group.add_argument("--shared-slurm", type=_gpus, metavar="GPUS",
                       help="compare one Slurm cluster of GPUS shared by inference and a training backlog with two "
                            "separate clusters of the same total (kvgate's policy only)")
    group.add_argument("--slurm-grace-s", type=non_negative_float, metavar="S",
                       help="GraceTime of the preemptible training partition (default: 60)")
    group.add_argument("--inference-gpus", type=_gpus, metavar="N",
                       help="G_inf, the separate inference cluster (default: kvgate's peak on a dedicated cluster)")
    group.add_argument("--inference-ceiling-gpus", type=_gpus, metavar="N",
                       help="the most GPUs inference may hold in the shared cluster (default: G_inf)")
    group.add_argument("--inference-reserve-gpus", type=_count, metavar="N",
                       help="GPUs the shared cluster keeps free for inference while it holds fewer: starts within "
                            "them wait for no grace, and training never runs there (default: 0)")
    group.add_argument("--training-gpus-per-job", type=_gpu_sizes, metavar="LIST",
                       help=f"each backlog job's GPUs, drawn uniformly from LIST (default: "
                            f"{','.join(map(str, backlog.gpus_per_job))})")
    group.add_argument("--training-mean-runtime-h", type=positive_float, metavar="H",
                       help=f"mean runtime of a backlog job, lognormal (default: {backlog.mean_runtime_s / 3600:g})")
    group.add_argument("--training-checkpoint-every-s", type=positive_float, metavar="S",
                       help=f"seconds of progress between a job's checkpoints (default: "
                            f"{backlog.checkpoint_every_s:g})")
    group.add_argument("--training-checkpoint-s", type=non_negative_float, metavar="S",
                       help=f"seconds one checkpoint takes: a preempted job checkpoints at SIGTERM only if the grace "
                            f"is at least this, else loses its progress since the last one (default: "
                            f"{backlog.checkpoint_s:g})")
    group.add_argument("--training-queue-depth", type=_gpus, metavar="N",
                       help=f"backlog jobs waiting at every moment (default: {backlog.queue_depth})")


_SHARING_ONLY = ("slurm_grace_s", "inference_gpus", "inference_ceiling_gpus", "inference_reserve_gpus",
                 "training_gpus_per_job", "training_mean_runtime_h", "training_checkpoint_every_s",
                 "training_checkpoint_s", "training_queue_depth")


def _sharing_spec(args: argparse.Namespace) -> SharingSpec | None:
    """The --shared-slurm comparison asked for, or None; raises `SimConfigError` for options that do not go with
    it (or need it)."""
    if args.shared_slurm is None:
        given = [name for name in _SHARING_ONLY if getattr(args, name) is not None]
        if given:
            raise SimConfigError(f"--{given[0].replace('_', '-')} needs --shared-slurm GPUS")
        return None
    clashes = [flag for flag, on in (("--policy", bool(args.policy) and set(args.policy) != {"kvgate"}),
                                     ("--sweep", args.sweep), ("--plot", bool(args.plot)),
                                     ("--stockout", bool(args.stockout)),
                                     ("--spot-interruptions-per-hour", bool(args.spot_interruptions_per_hour)),
                                     ("--start-failure-rate", bool(args.start_failure_rate))) if on]
    if clashes:
        raise SimConfigError(f"{clashes[0]} does not go with --shared-slurm: it runs kvgate alone on an owned cluster")
    d = BacklogSpec()
    runtime_h = args.training_mean_runtime_h
    backlog = BacklogSpec(
        gpus_per_job=args.training_gpus_per_job or d.gpus_per_job,
        mean_runtime_s=d.mean_runtime_s if runtime_h is None else runtime_h * 3600,
        checkpoint_every_s=args.training_checkpoint_every_s or d.checkpoint_every_s,
        checkpoint_s=d.checkpoint_s if args.training_checkpoint_s is None else args.training_checkpoint_s,
        queue_depth=args.training_queue_depth or d.queue_depth, seed=args.seed)
    return SharingSpec(args.shared_slurm, backlog, 60.0 if args.slurm_grace_s is None else args.slurm_grace_s,
                       args.inference_gpus, args.inference_ceiling_gpus, args.inference_reserve_gpus or 0)


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
    _add_sharing_options(parser)
    return parser


def _trace(args: argparse.Namespace) -> Trace:
    """The trace the options name, cut, compressed and scaled; raises `TraceError` (or OSError)."""
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
    return trace


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sharing = _sharing_spec(args)
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
        trace = _trace(args)
        started = time.perf_counter()
        if sharing is not None:
            shared = compare_sharing(trace, snapshot, model, sharing, warmup_s=max(0.0, args.warmup_s),
                                     kvgate_scaling=dict(args.kvgate_set))
        else:
            scenario = Scenario(spot_interruptions_per_hour=args.spot_interruptions_per_hour,
                                stockouts=tuple(args.stockout), start_failure_rate=args.start_failure_rate,
                                seed=args.seed)
            comparison = run_comparison(trace, snapshot, model, policies=args.policy or POLICIES, sweep=args.sweep,
                                        scenario=scenario, warmup_s=max(0.0, args.warmup_s),
                                        kvgate_scaling=dict(args.kvgate_set))
        elapsed = time.perf_counter() - started
    except (RegistryInvalid, TraceError, SimConfigError, UnknownName, OSError) as error:
        print(f"kvgate sim: {error}", file=sys.stderr)
        return 2
    if sharing is not None:
        print(sharing_table(shared))
        print(f"\nsimulated {trace.duration_s / 60:.1f} min x 2 arrangements (+ sizing G_inf) in {elapsed:.1f}s")
    else:
        print(table(comparison))
        print(f"\nsimulated {trace.duration_s / 60:.1f} min x {len(comparison.results)} policies "
              f"(+ oracle search) in {elapsed:.1f}s")
    try:
        if args.json:
            if sharing is not None:
                Path(args.json).write_text(json.dumps(sharing_json(shared), indent=1) + "\n")
            else:
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
