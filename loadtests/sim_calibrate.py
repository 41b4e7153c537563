"""How close the simulator's service model comes to a real `kvgate engine`: the same requests, the same arrival
times, TTFT percentiles side by side.

    .venv/bin/python loadtests/sim_calibrate.py                    # SmolLM2-135M on this CPU, ~8 min
    .venv/bin/python loadtests/sim_calibrate.py --loads 0.3,0.6 --requests 40

1. Starts one real engine (`builtin:smollm2-135m`, `--max-num-seqs` slots) and measures what the registry's
   `performance` entry would declare for it: prefill tokens/s (one long prompt at a time, TTFT of 1-token answers)
   and decode tokens/s summed over a full batch (`max-num-seqs` answers at once, after their first token).
2. For each load (a fraction of the capacity those figures imply), draws a seeded Poisson trace of prompts and
   answers of lognormal lengths, replays it to the engine at its arrival times (streamed, `ignore_eos`), and
   records each request's TTFT.
3. Replays the same trace through the simulator's service model (`autoscaler/sim/batching.py`: engine steps of
   chunked prefill beside decode, under the same step budget) on one replica with the measured figures.
Prints engine and simulator p50 / p90 / p99 TTFT per load and their ratios; writes
loadtests/.work/sim_calibrate.json (after each load, so a run cut short keeps what it measured). The engine shares
this box's 2 cores with the client: run it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtests.common import (make_prompts, percentile, read_completion_stream, start_engine,  # noqa: E402
                              stop_process_group)

from kvgate.autoscaler.sim.baselines import StaticPolicy  # noqa: E402
from kvgate.autoscaler.sim.engine import simulate  # noqa: E402
from kvgate.autoscaler.sim.records import FleetSetup  # noqa: E402
from kvgate.autoscaler.sim.service import Placement, ServiceModel  # noqa: E402
from kvgate.autoscaler.sim.traces import Request, Trace  # noqa: E402
from kvgate.registry.schema import CapacityType  # noqa: E402

WORK = ROOT / "loadtests" / ".work"
VOCAB = 49152  # SmolLM2's


async def one(session, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, total seconds, completion tokens) of one streamed completion."""
    body = {"model": "calib", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        first, count = await read_completion_stream(response, time.perf_counter)
    end = time.perf_counter()
    return (first or end) - start, end - start, count


async def measure_figures(session, url: str, args: argparse.Namespace) -> dict:
    """What a registry entry for this engine would say: prefill and full-batch decode tokens/s."""
    long_prompts = make_prompts(VOCAB, 4, args.prefill_probe_tokens, seed=7)
    await one(session, url, long_prompts[0], 1)  # warm-up
    ttfts = sorted([(await one(session, url, p, 1))[0] for p in long_prompts[1:]])
    prefill = args.prefill_probe_tokens / ttfts[len(ttfts) // 2]
    batch = make_prompts(VOCAB, args.max_num_seqs, 16, seed=8)
    results = await asyncio.gather(*(one(session, url, p, args.decode_probe_tokens) for p in batch))
    # Decode after each first token: tokens beyond the first over the time from the first token to the last.
    decode_s = max(total - ttft for ttft, total, _ in results)
    decode = sum(count - 1 for _, _, count in results) / decode_s
    return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "max_batch": args.max_num_seqs,
            "max_batch_tokens": args.max_num_batched_tokens}


def lognormal(rng: random.Random, median: int, cap: int) -> int:
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), 0.6))))


def draw_trace(rate: float, count: int, args: argparse.Namespace, seed: int) -> Trace:
    rng = random.Random(seed)
    t, requests = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        requests.append(Request(t, lognormal(rng, args.median_prompt, 900), lognormal(rng, args.median_answer, 256)))
    return Trace(f"poisson-{rate:.2f}", tuple(requests))


async def replay(session, url: str, trace: Trace, seed: int) -> list[float]:
    """TTFT of every request, each sent at its arrival time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, VOCAB) for _ in range(r.input_tokens)] for r in trace.requests]
    start = time.perf_counter()

    async def at(request: Request, prompt: list[int]) -> float:
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        return (await one(session, url, prompt, request.output_tokens))[0]

    return list(await asyncio.gather(*(at(r, p) for r, p in zip(trace.requests, prompts))))


def simulated(trace: Trace, figures: dict) -> list[float]:
    service = ServiceModel("cpu", figures["prefill_tokens_per_s"], figures["decode_tokens_per_s"], figures["max_batch"],
                           max_batch_tokens=figures["max_batch_tokens"])
    fleet = FleetSetup("calib", (Placement("local", "cpu", CapacityType.ON_DEMAND, 0.0, 1, 0.0, service),),
                       min_replicas=1, max_replicas=1, on_demand_base=1, ttft_slo_s=1.0, initial_replicas=1,
                       tail_s=600.0)
    return list(simulate(trace, fleet, StaticPolicy(1)).ttft_s)


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {f"p{q}": percentile(ordered, q / 100) for q in (50, 90, 99)}


async def run(args: argparse.Namespace) -> dict:
    result: dict = {"model": args.model, "rows": []}
    import aiohttp

    process, url = start_engine(["--model", args.model, "--max-num-seqs", str(args.max_num_seqs),
                                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                 "--served-model-name", "calib", "--log-level", "warning"],
                                WORK / "sim_calibrate-engine.log", ROOT)
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            figures = await measure_figures(session, url, args)
            print(f"measured: prefill {figures['prefill_tokens_per_s']:.0f} tokens/s, decode "
                  f"{figures['decode_tokens_per_s']:.0f} tokens/s over a batch of {figures['max_batch']}", flush=True)
            # Capacity in requests/s: the tighter of prefill and decode for the mean request.
            probe = draw_trace(1.0, 2000, args, seed=0)
            mean_in = sum(r.input_tokens for r in probe.requests) / len(probe.requests)
            mean_out = sum(r.output_tokens for r in probe.requests) / len(probe.requests)
            capacity = 1.0 / (mean_in / figures["prefill_tokens_per_s"] + mean_out / figures["decode_tokens_per_s"])
            result.update(figures=figures, mean_prompt=mean_in, mean_answer=mean_out, capacity_rps=capacity)
            rows = result["rows"]
            for i, load in enumerate(args.loads):
                trace = draw_trace(load * capacity, args.requests, args, seed=100 + i)
                engine = await replay(session, url, trace, seed=200 + i)
                sim = simulated(trace, figures)
                row = {"load": load, "rate_rps": load * capacity, "requests": len(trace.requests),
                       "engine": quantiles(engine), "sim": quantiles(sim)}
                rows.append(row)
                Path(args.out).write_text(json.dumps(result, indent=1))
                print(f"load {load:.0%} ({load * capacity:.2f} req/s): engine p50/p90/p99 "
                      + " / ".join(f"{row['engine'][k]:.3f}" for k in ("p50", "p90", "p99")) + " s; sim "
                      + " / ".join(f"{row['sim'][k]:.3f}" for k in ("p50", "p90", "p99")) + " s", flush=True)
    finally:
        stop_process_group(process)
    return result


def table(result: dict) -> str:
    lines = ["| load | req/s | engine p50 / p90 / p99 TTFT | simulator p50 / p90 / p99 | sim / engine p50, p90, p99 |",
             "|---:|---:|---|---|---|"]
    for row in result["rows"]:
        e, s = row["engine"], row["sim"]
        ratios = ", ".join(f"{s[k] / e[k]:.2f}x" for k in ("p50", "p90", "p99"))
        lines.append(f"| {row['load']:.0%} | {row['rate_rps']:.2f} | "
                     + " / ".join(f"{e[k] * 1000:.0f}" for k in ("p50", "p90", "p99")) + " ms | "
                     + " / ".join(f"{s[k] * 1000:.0f}" for k in ("p50", "p90", "p99")) + f" ms | {ratios} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's batch (default 8)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the engine's step budget, and the service model's (default 2048)")
    parser.add_argument("--loads", default="0.3,0.6,0.85", help="fractions of the measured capacity")
    parser.add_argument("--requests", type=int, default=80, help="requests per load (default 80)")
    parser.add_argument("--median-prompt", type=int, default=200)
    parser.add_argument("--median-answer", type=int, default=24)
    parser.add_argument("--prefill-probe-tokens", type=int, default=768)
    parser.add_argument("--decode-probe-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(WORK / "sim_calibrate.json"))
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",")]
    WORK.mkdir(parents=True, exist_ok=True)
    import uvloop

    result = uvloop.run(run(args))
    print(table(result))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
