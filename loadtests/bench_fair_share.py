"""Fair sharing under overload: a noisy tenant offering 5x the fleet's capacity beside a quiet tenant at 20% of it.

For each fleet shape, three runs through a real `kvgate router` over simulated replicas (`sim_replica.py`, each a
process, vLLM-style `/metrics` that the gateway scrapes; their capacity is learned, not configured):

  alone   the quiet tenant by itself: the TTFT it gets on an otherwise idle fleet
  fair    both tenants, fair queuing on (the default): the quiet tenant's TTFT and whether any of it was shed
  fair-configured  the same with `max_in_flight_per_replica` set to the replicas' batch instead of learned
  fifo    both tenants, `fair_queueing: false` (the gateway as it was): every request goes straight on and
          the replicas queue them first come, first served

Each tenant's requests arrive open loop (Poisson) and stream, their answers from half to one and a half times the
shape's mean length (`--lockstep`: all the same length); TTFT is the time to the first content. The model's
`slo.ttft_ms` is the shed budget. The table gives the quiet tenant's p50/p99 TTFT per run and its p99 over its p99
alone (issue 27's bar: <= 1.25 with fair sharing, never shed), and the noisy tenant's good answers a second (its
first token within the SLO).

    .venv/bin/python loadtests/bench_fair_share.py                  # both shapes, 60 s a run
    .venv/bin/python loadtests/bench_fair_share.py --duration-s 30 --shapes chat
    .venv/bin/python loadtests/bench_fair_share.py --shapes chat --lockstep   # the worst case for the quiet tenant

Writes JSON to loadtests/.work/bench_fair_share.json. The sims, the gateway and the load generator share this
machine's cores; ratios are what carry over, not the milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgate.registry.tenant import KEY_SECRET_ENV, key_hmac  # noqa: E402  (after the path is set)
from loadtests.bench_gateway_overhead import stop_gateway, wait_healthy, wait_routable  # noqa: E402
from loadtests.common import free_port, percentile, stop_process_group  # noqa: E402

WORK = ROOT / "loadtests" / ".work"
MODEL = "m"
NOISY_X, QUIET_X = 5.0, 0.2  # each tenant's offered load, in multiples of the fleet's capacity
LEARN_S = 8.0  # the gateway learns what the replicas run at once within this (they report every 1 s)
RUNS = ("alone", "fair", "fair-configured", "fifo")
MODE_ROUTING = {"learned": "", "configured": "max_in_flight_per_replica: {batch},", "fifo": "fair_queueing: false,"}


@dataclass(frozen=True)
class Shape:
    """A fleet and its requests; `max_tokens` is the mean output (each request draws from half to one and a half
    times it, unless the run is in lockstep)."""

    name: str
    replicas: int
    max_batch: int
    prompt_chars: int  # 4 characters a token
    max_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # per running sequence
    slo_ttft_ms: float

    @property
    def capacity_per_s(self) -> float:
        """Requests a second the replicas serve with every place taken. A sim replica's step decodes its whole
        batch in 1 / decode_tokens_per_s and adds the prefill of the prompts it starts, which emits their first
        token; a second of it serves X requests when X x prefill_s + X x (max_tokens - 1) / batch x decode_s = 1.
        (The prefill is charged to the whole batch: leaving it out overstated chat's capacity by 21% and long's
        by 40%, so the "quiet" tenant offered more than its 20%.)"""
        prefill_s = self.prompt_chars / 4 / self.prefill_tokens_per_s
        per_replica = 1 / (prefill_s + (self.max_tokens - 1) / self.max_batch / self.decode_tokens_per_s)
        return self.replicas * per_replica

    @property
    def warmup_s(self) -> float:
        """Not counted: LEARN_S, then two requests' time in a full batch, for what the replicas queued before the
        gateway knew their capacity to drain (a request sent then waits behind it inside the replica)."""
        return LEARN_S + 2 * self.replicas * self.max_batch / self.capacity_per_s


# Few output tokens at a slow decode: a request holds its place as long as a real one does, while this 2-core box
# relays a tenth of the chunks (a token a chunk), which would otherwise take the CPU the measurement needs.
SHAPES = {
    # Chat: 500-token prompts, 24 tokens out at 16 a second each, 16 at once on each of 2 replicas.
    "chat": Shape("chat", replicas=2, max_batch=16, prompt_chars=2000, max_tokens=24,
                  prefill_tokens_per_s=20_000, decode_tokens_per_s=16, slo_ttft_ms=2000),
    # Long prompts and slow answers, 8 at once on each of 2 replicas: few places, each held ~3 s.
    "long": Shape("long", replicas=2, max_batch=8, prompt_chars=8000, max_tokens=24,
                  prefill_tokens_per_s=10_000, decode_tokens_per_s=8, slo_ttft_ms=5000),
}


# ------------------------------------------------------------------------------------ the fleet


def start_sims(shape: Shape) -> list[tuple[subprocess.Popen, str]]:
    sims = []
    for _ in range(shape.replicas):
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "loadtests" / "sim_replica.py"), "--port", str(port), "--model", MODEL,
             "--max-batch", str(shape.max_batch), "--prefill-tokens-per-s", str(shape.prefill_tokens_per_s),
             "--decode-tokens-per-s", str(shape.decode_tokens_per_s), "--max-prefill-tokens-per-step", "8192",
             "--no-prefix-caching"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sims.append((process, f"http://127.0.0.1:{port}"))
    for process, url in sims:
        wait_healthy(url + "/health", process)
    return sims


def write_registry(directory: Path, shape: Shape, urls: list[str], mode: str, secret: str,
                   keys: dict[str, str]) -> None:
    """`mode`: learned (fair queuing, capacity learned), configured (fair queuing, max_in_flight_per_replica set
    to the replicas' batch) or fifo (fair queuing off)."""
    directory.mkdir(parents=True, exist_ok=True)
    static = ", ".join(f"{{url: '{url}', backend: vllm}}" for url in urls)
    tenants = "".join(f"""---
apiVersion: kvgate/v1
kind: Tenant
metadata: {{name: {name}}}
spec: {{api_key_hmac: "{key_hmac(secret.encode(), key)}", models: ['*']}}
""" for name, key in keys.items())
    (directory / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {MODEL}}}
spec:
  source: builtin:tiny-llama
  slo: {{ttft_ms: {shape.slo_ttft_ms:g}}}
  routing: {{policy: least_load, {MODE_ROUTING[mode].format(batch=shape.max_batch)} static_replicas: [{static}]}}
{tenants}""")


def start_gateway(directory: Path, secret: str) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{(port := free_port())}"
    process = subprocess.Popen([sys.executable, "-m", "kvgate.router", "--registry", str(directory), "--port",
                                str(port), "--log-level", "WARNING"], env={**os.environ, KEY_SECRET_ENV: secret},
                               cwd=ROOT)
    wait_healthy(url + "/health", process)
    wait_routable(url)
    return process, url


# ------------------------------------------------------------------------------------ load


@dataclass
class Answer:
    tenant: str
    sent_at: float
    status: int
    ttft_s: float | None  # None: no content came


def output_tokens(shape: Shape, rng: random.Random, lockstep: bool) -> int:
    """A request's length: uniform from half to one and a half times the shape's mean, as answers vary. In
    lockstep every request is as long, so those that start together end together, and a tenant waiting for places
    gets them all in one step and prefills them at once in the replica (what the quiet tenant then waits behind is
    the replica's, not the gateway's: docs/benchmarks.md, Fair sharing)."""
    return shape.max_tokens if lockstep else rng.randint(shape.max_tokens // 2, shape.max_tokens * 3 // 2)


async def one_request(session: aiohttp.ClientSession, url: str, key: str, shape: Shape, tenant: str,
                      rng: random.Random, started: float, lockstep: bool) -> Answer:
    prompt = f"{tenant} {rng.random():.12f} " + "tell me more about fair queues " * (shape.prompt_chars // 31)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt[:shape.prompt_chars]}],
            "max_tokens": output_tokens(shape, rng, lockstep), "stream": True}
    sent = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as response:
            ttft = None
            if response.status == 200:
                async for line in response.content:
                    if ttft is None and line.startswith(b"data: {") and b'"content"' in line:
                        ttft = time.monotonic() - sent
            else:
                await response.read()
            return Answer(tenant, sent - started, response.status, ttft)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Answer(tenant, sent - started, 0, None)


async def offer(url: str, keys: dict[str, str], rates: dict[str, float], shape: Shape, duration_s: float,
                seed: int, lockstep: bool = False) -> list[Answer]:
    """Each tenant's Poisson arrivals at its rate for `duration_s`; every answer, read to its end."""
    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def tenant_load(tenant: str, rate: float, rng: random.Random) -> list[asyncio.Task[Answer]]:
            tasks, at = [], 0.0
            while True:
                at += rng.expovariate(rate)
                if at >= duration_s:
                    return tasks
                await asyncio.sleep(max(0.0, started + at - time.monotonic()))
                tasks.append(asyncio.create_task(one_request(session, url, keys[tenant], shape, tenant, rng,
                                                             started, lockstep)))

        groups = await asyncio.gather(*(tenant_load(t, r, random.Random(f"{seed}-{t}"))
                                        for t, r in rates.items() if r > 0))
        return list(await asyncio.gather(*(task for group in groups for task in group)))


# ------------------------------------------------------------------------------------ runs


def summarize(answers: list[Answer], tenant: str, duration_s: float, warmup_s: float, slo_ms: float) -> dict:
    """One tenant's answers to the requests it sent after the warm-up. `good_per_s`: answers whose first token
    came within the SLO, per second of the run (what it was served usefully; a backlog drained late is not)."""
    mine = [a for a in answers if a.tenant == tenant and a.sent_at >= warmup_s]
    ttfts = sorted(a.ttft_s * 1000 for a in mine if a.status == 200 and a.ttft_s is not None)
    slowest = sorted((a for a in mine if a.status == 200 and a.ttft_s is not None), key=lambda a: -a.ttft_s)[:5]
    return {"sent": len(mine), "served": len(ttfts), "shed": sum(a.status in (429, 503) for a in mine),
            "slowest": [{"sent_at_s": round(a.sent_at, 3), "ttft_ms": round(a.ttft_s * 1000, 1)} for a in slowest],
            "failed": sum(a.status not in (200, 429, 503) or (a.status == 200 and a.ttft_s is None) for a in mine),
            "good_per_s": sum(ttft <= slo_ms for ttft in ttfts) / max(duration_s - warmup_s, 1e-9),
            "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p99_ms": percentile(ttfts, 0.99)}


def run_shape(shape: Shape, duration_s: float, seed: int, lockstep: bool, only: tuple[str, ...] = RUNS) -> dict:
    secret = secrets.token_urlsafe(32)
    keys = {"noisy": secrets.token_urlsafe(24), "quiet": secrets.token_urlsafe(24)}
    capacity = shape.capacity_per_s
    both = {"noisy": NOISY_X * capacity, "quiet": QUIET_X * capacity}
    plans = {"alone": ("learned", {"quiet": QUIET_X * capacity}), "fair": ("learned", both),
             "fair-configured": ("configured", both), "fifo": ("fifo", both)}
    runs = {}
    for name, (mode, rates) in plans.items():
        if name not in only:
            continue
        sims = start_sims(shape)
        directory = WORK / f"fair-share-{shape.name}-{name}"
        write_registry(directory, shape, [url for _, url in sims], mode, secret, keys)
        gateway, url = start_gateway(directory, secret)
        try:
            answers = asyncio.run(offer(url, keys, rates, shape, duration_s, seed, lockstep))
        finally:
            stop_gateway(gateway)
            for process, _ in sims:
                stop_process_group(process)
        runs[name] = {tenant: summarize(answers, tenant, duration_s, shape.warmup_s, shape.slo_ttft_ms)
                      for tenant in rates}
        quiet = runs[name]["quiet"]
        print(f"  {shape.name:6s} {name:15s} quiet p99 {quiet['ttft_p99_ms'] or 0:8.1f} ms, "
              f"shed {quiet['shed']}", file=sys.stderr)
    alone_p99 = runs["alone"]["quiet"]["ttft_p99_ms"]
    for name in set(runs) - {"alone"}:
        p99 = runs[name]["quiet"]["ttft_p99_ms"]
        runs[name]["quiet_p99_over_alone"] = p99 / alone_p99 if p99 and alone_p99 else None
    return {"shape": asdict(shape), "capacity_per_s": capacity, "warmup_s": shape.warmup_s, "runs": runs}


def report(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nFair sharing: noisy tenant at {NOISY_X:g}x the fleet's capacity, quiet at {QUIET_X:g}x "
          f"({args.duration_s:g} s a run, the first {LEARN_S:g} s + two requests' time not counted"
          f"{'; every request as long' if args.lockstep else ''})\n")
    print(f"{'shape':6s} {'run':15s} {'quiet p50':>10s} {'quiet p99':>10s} {'p99/alone':>10s} {'quiet shed':>11s} "
          f"{'noisy good/s':>13s} {'noisy shed':>11s}")
    for result in results:
        for name, run in result["runs"].items():
            quiet, noisy = run["quiet"], run.get("noisy")
            ratio = run.get("quiet_p99_over_alone")
            ratio_text = f"{ratio:.2f}x" if ratio else "-"
            noisy_shed = f"{noisy['shed']}/{noisy['sent']}" if noisy else "-"
            print(f"{result['shape']['name']:6s} {name:15s} {quiet['ttft_p50_ms'] or 0:8.1f}ms "
                  f"{quiet['ttft_p99_ms'] or 0:8.1f}ms {ratio_text:>10s} {quiet['shed']:>5d}/{quiet['sent']:<5d} "
                  f"{noisy['good_per_s'] if noisy else 0:>13.1f} {noisy_shed:>11s}")
        print(f"{result['shape']['name']:6s} capacity {result['capacity_per_s']:.1f} req/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"noisy_x": NOISY_X, "quiet_x": QUIET_X, "duration_s": args.duration_s,
                               "lockstep": args.lockstep,
                               "results": results}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--duration-s", type=float, default=60.0, help="each run's length, warm-up included")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lockstep", action="store_true",
                        help="every request the shape's mean length (by default each draws from 0.5x to 1.5x it)")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated, of {', '.join(RUNS)} (alone is always run: the others are judged "
                             "against it)")
    parser.add_argument("--out", default=str(WORK / "bench_fair_share.json"))
    args = parser.parse_args()
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(sorted(unknown))}; choose from {', '.join(SHAPES)}")
    only = ("alone", *args.runs.split(","))
    if set(only) - set(RUNS):
        parser.error(f"unknown run(s) {', '.join(sorted(set(only) - set(RUNS)))}; choose from {', '.join(RUNS)}")
    WORK.mkdir(parents=True, exist_ok=True)
    results = [run_shape(SHAPES[name], args.duration_s, args.seed, args.lockstep, only)
               for name in args.shapes.split(",")]
    report(results, args)


if __name__ == "__main__":
    main()
