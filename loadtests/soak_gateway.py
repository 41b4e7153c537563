"""Gateway memory soak: does `kvgate router`'s memory settle under hours of steady traffic, and if not, where does it go?

What runs (each its own process, all on this machine):
  replicas  2 simulated replicas (`sim_replica.py`, started by `routing_fleet.start_fleet`), KV --kv-tokens each,
            fast enough that they never queue at the default rate
  gateway   the real `kvgate router` (policy cache_aware, the replicas as static replicas, `routing_fleet`),
            started with PYTHONTRACEMALLOC=1 (--trace-frames; 0: no tracing, the RSS as in production)
  load      this script: an open loop at --rate requests/s (request i is sent at i / rate s, whether or not earlier
            ones have ended), each request drawn from a seeded mix (`soak_request`):
              55% distinct   a chat prompt of 1,500-6,000 characters never seen before: the prefix index fills to its
                             cap (~2 x 1,024 chunks at the defaults) within seconds and then evicts all run long
              25% shared     one of 16 system prompts (2,400 characters) + a new question: prefix hits
              10% completion /v1/completions, one of 8 documents + a new tail
               8% adapter    one of the 4 LoRA adapters, its own system prompt + a new question
               2% unknown    a model name never seen before: a 404 (counted as `refused`, not as an error); a
                             gateway that kept per-name state for them would grow
            half of them streamed (half of those with stream_options.include_usage), max_tokens 4-24, and a
            distinct X-Request-Id each

What it measures:
  every --sample-s  the gateway's RSS (/proc/PID/status VmRSS), its traced Python bytes (GET /admin/memory?top=0,
                    no snapshot), its CPU seconds, requests done and errors, the prefix index's entries / cap
  at --baseline-s   POST /admin/memory/baseline (per-site totals of a tracemalloc snapshot; default: 62 minutes in,
                    or a third of a shorter run): after warm-up, with the prefix index at its cap and the
                    dashboard's one-hour history full (it grows until then: router/stats_history.py)
  every --snapshot-s GET /admin/memory?top=25: the largest sites and the growth since the baseline; the last one,
                    at the end, is what the report names as the growth sites

At the end: a table (time, RSS MiB, traced MiB, requests, errors, index fill) at about 13 rows, the RSS and
traced slopes (least squares, MiB per hour) over the last 30 minutes (the last half of a shorter run), the
sites that grew most, and JSON to --out (every sample, every snapshot, the summary). The gateway's log goes
beside it (soak_gateway.json -> soak_gateway.gateway.log).

    .venv/bin/python loadtests/soak_gateway.py --minutes 5                  # a check that it all works
    nohup .venv/bin/python loadtests/soak_gateway.py --minutes 95 --out /tmp/soak.json > /tmp/soak.log 2>&1 &

Questions:
  Does tracing change the figures?  Yes: tracemalloc keeps ~50 bytes per live block (reported as
      tracemalloc_overhead_bytes) and every snapshot copies all traces for a moment, so the RSS with tracing
      is higher than without; it grows only if the number of live blocks grows. Compare with --trace-frames 0.
  Why RSS and traced?  Traced bytes are what Python objects hold; RSS adds the interpreter, C libraries,
      freed-but-kept memory (pymalloc arenas, glibc's heap) and fragmentation. Traced flat while RSS climbs:
      not a Python-level leak. Traced climbing: the growth list names the line.
  How much CPU?  At 35 req/s the gateway takes ~7% of a core (~14% traced), each replica and the load generator
      a few % each: two soaks (traced and not) side by side fit a 2-core box shared with other work.
  What is "full gcs"?  The gateway's collections of its oldest generation (GET /admin/memory's `gc`). The gateway
      collects rarely (router/main.py's GC_GEN0_THRESHOLD), so cyclic garbage waits long; each snapshot says how
      much a full collection would free then (`garbage`, by type).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvgate.router.memory import MIB, vm_rss_bytes  # noqa: E402
from loadtests.bench_gateway_overhead import process_cpu_s  # noqa: E402
from loadtests.bench_routing import wait_ready  # noqa: E402
from loadtests.routing_fleet import MODEL, WORK, start_fleet, start_router, stop_router  # noqa: E402
from loadtests.workloads import ADAPTERS, paragraph  # noqa: E402

SHARED_SYSTEM_PROMPTS = 16
DOCUMENTS = 8
TABLE_ROWS = 13
SLOPE_WINDOW_S = 1800.0  # the slope the report gives: over the last 30 minutes (the last half of a shorter run)


# ------------------------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class SoakRequest:
    path: str
    body: dict
    kind: str  # distinct, shared, completion, adapter, unknown

    @property
    def expect_status(self) -> int:
        return 404 if self.kind == "unknown" else 200


def soak_request(i: int, seed: int = 0) -> SoakRequest:
    """Request i of the soak's mix (module docstring): the same i and seed, the same request."""
    rng = random.Random(f"soak:{seed}:{i}")
    roll = rng.random()
    chat, model = True, MODEL
    if roll < 0.55:
        kind, messages = "distinct", [{"role": "user", "content": paragraph(("distinct", seed, i),
                                                                            rng.randint(1500, 6000))}]
    elif roll < 0.80:
        kind = "shared"
        messages = [{"role": "system", "content": paragraph(("system", rng.randrange(SHARED_SYSTEM_PROMPTS)), 2400)},
                    {"role": "user", "content": paragraph(("question", seed, i), rng.randint(120, 400))}]
    elif roll < 0.90:
        kind, chat = "completion", False
        prompt = paragraph(("document", rng.randrange(DOCUMENTS)), 3000) + paragraph(("tail", seed, i), 800)
    elif roll < 0.98:
        kind, model = "adapter", ADAPTERS[rng.randrange(len(ADAPTERS))]
        messages = [{"role": "system", "content": paragraph(("adapter-system", model), 1600)},
                    {"role": "user", "content": paragraph(("adapter-question", seed, i), rng.randint(100, 300))}]
    else:
        kind, model = "unknown", f"no-such-model-{seed}-{i}"
        messages = [{"role": "user", "content": "hello"}]
    body: dict = {"model": model, "max_tokens": rng.randint(4, 24)}
    body.update({"messages": messages} if chat else {"prompt": prompt})
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return SoakRequest("/v1/chat/completions" if chat else "/v1/completions", body, kind)


# ------------------------------------------------------------------------------------------- figures


@dataclass
class Counts:
    sent: int = 0
    done: int = 0
    errors: int = 0
    refused: int = 0  # the 404s the mix asks for
    error_kinds: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.errors += 1
        self.error_kinds[why] = self.error_kinds.get(why, 0) + 1


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_mib: float | None
    traced_mib: float | None
    tracemalloc_overhead_mib: float | None
    gateway_cpu_s: float
    num_sent: int
    num_done: int
    num_errors: int
    num_refused: int
    index_entries: int | None
    index_capacity: int | None
    num_full_collections: int | None = None  # the gateway's gc runs of its oldest generation so far


def slope_per_h(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per hour; None for fewer than 2 points or no spread.
    (0, 76.0), (1800, 77.0), (3600, 78.0) -> 2.0 MiB/h."""
    if len(points) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 3600.0


def window_slopes(samples: list[Sample], window_s: float = SLOPE_WINDOW_S) -> dict:
    """RSS and traced slopes over the last `window_s` (the last half of a run shorter than twice it)."""
    if not samples:
        return {}
    end = samples[-1].t_s
    start = end - min(window_s, end / 2)
    last = [s for s in samples if s.t_s >= start]
    return {"from_s": start, "to_s": end,
            "rss_mib_per_h": slope_per_h([(s.t_s, s.rss_mib) for s in last if s.rss_mib is not None]),
            "traced_mib_per_h": slope_per_h([(s.t_s, s.traced_mib) for s in last if s.traced_mib is not None])}


def table_rows(samples: list[Sample], num_rows: int = TABLE_ROWS) -> list[Sample]:
    """About `num_rows` samples evenly spread over the run, the first and the last always among them."""
    if len(samples) <= num_rows:
        return list(samples)
    step = (len(samples) - 1) / (num_rows - 1)
    return [samples[round(k * step)] for k in range(num_rows)]


def _mib(value: float | None, width: int = 8) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.1f}"


def format_table(samples: list[Sample]) -> str:
    lines = [f"{'time':>7s} {'RSS MiB':>8s} {'traced':>8s} {'requests':>9s} {'errors':>7s} {'index':>12s} "
             f"{'full gcs':>8s}"]
    for s in table_rows(samples):
        index = "-" if s.index_entries is None else f"{s.index_entries}/{s.index_capacity}"
        gcs = "-" if s.num_full_collections is None else str(s.num_full_collections)
        lines.append(f"{_clock(s.t_s):>7s} {_mib(s.rss_mib)} {_mib(s.traced_mib)} {s.num_done:9d} "
                     f"{s.num_errors:7d} {index:>12s} {gcs:>8s}")
    return "\n".join(lines)


def _clock(t_s: float) -> str:
    return f"{int(t_s) // 60}:{int(t_s) % 60:02d}"


# ------------------------------------------------------------------------------------------- the I/O


async def one_request(session, url: str, req: SoakRequest, counts: Counts) -> None:
    """Send one request, read its answer to the end, and count it."""
    import aiohttp
    headers = {"X-Request-Id": uuid.uuid4().hex}
    try:
        async with session.post(url + req.path, json=req.body, headers=headers) as r:
            data = await r.read()
            if r.status != req.expect_status:
                counts.fail(f"http {r.status}")
            elif r.status == 200 and req.body.get("stream") and not data.endswith(b"data: [DONE]\n\n"):
                counts.fail("stream without [DONE]")
            elif r.status == 200 and not req.body.get("stream") and b'"choices"' not in data:
                counts.fail("answer without choices")
            elif r.status != 200:
                counts.refused += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        counts.fail(type(exc).__name__)
    finally:
        counts.done += 1


async def drive(session, url: str, rate: float, duration_s: float, seed: int, counts: Counts) -> None:
    """The open loop: request i at start + i / rate, until `duration_s`; then waits for the ones in flight."""
    in_flight: set[asyncio.Task] = set()
    start = time.monotonic()
    while (due := start + counts.sent / rate) < start + duration_s:
        if (delay := due - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one_request(session, url, soak_request(counts.sent, seed), counts))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        counts.sent += 1
    await asyncio.gather(*in_flight)


async def get_json(session, url: str, method: str = "GET") -> dict | None:
    try:
        async with session.request(method, url) as r:
            return await r.json() if r.status == 200 else None
    except Exception:  # a look that fails is a gap in the figures, not the end of the soak
        return None


async def take_sample(session, url: str, pid: int, t_s: float, counts: Counts) -> Sample:
    try:
        rss = vm_rss_bytes(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        rss = None
    memory = await get_json(session, url + "/admin/memory?top=0") or {}
    stats = await get_json(session, url + "/admin/stats") or {}
    replicas = stats.get("models", {}).get(MODEL, {}).get("replicas")
    entries = sum(r["prefix_index_entries"] for r in replicas) if replicas else None
    capacity = sum(r["prefix_capacity_chunks"] for r in replicas) if replicas else None
    mib = lambda key: memory[key] / MIB if key in memory else None  # noqa: E731
    full_collections = memory["gc"]["collections"][-1] if "gc" in memory else None
    return Sample(t_s, None if rss is None else rss / MIB, mib("traced_current_bytes"),
                  mib("tracemalloc_overhead_bytes"), process_cpu_s(pid), counts.sent, counts.done, counts.errors,
                  counts.refused, entries, capacity, full_collections)


@dataclass
class Record:
    samples: list[Sample] = field(default_factory=list)
    snapshots: list[dict] = field(default_factory=list)  # /admin/memory answers with sites, each with its t_s
    baseline: dict | None = None


async def observe(session, url: str, pid: int, args: argparse.Namespace, counts: Counts, record: Record,
                  start: float, done: asyncio.Event) -> None:
    """Samples every --sample-s, the baseline at --baseline-s, snapshots every --snapshot-s after it."""
    next_snapshot = args.baseline_s + args.snapshot_s
    while True:
        t_s = time.monotonic() - start
        sample = await take_sample(session, url, pid, t_s, counts)
        record.samples.append(sample)
        print(f"[{_clock(t_s):>6s}] rss {_mib(sample.rss_mib, 6)} MiB  traced {_mib(sample.traced_mib, 6)} MiB  "
              f"sent {sample.num_sent:7d}  errors {sample.num_errors}  index {sample.index_entries}/"
              f"{sample.index_capacity}", flush=True)
        if record.baseline is None and t_s >= args.baseline_s:
            record.baseline = {"t_s": t_s, **(await get_json(session, url + "/admin/memory/baseline", "POST") or {})}
        elif record.baseline is not None and t_s >= next_snapshot:
            await snapshot(session, url, t_s, record, 25)
            next_snapshot += args.snapshot_s
        try:
            await asyncio.wait_for(done.wait(), timeout=max(0.0, start + t_s + args.sample_s - time.monotonic()))
            return
        except TimeoutError:
            pass


async def snapshot(session, url: str, t_s: float, record: Record, top: int) -> None:
    answer = await get_json(session, url + f"/admin/memory?top={top}")
    if answer is not None:
        record.snapshots.append({"t_s": t_s, **answer})


async def soak(url: str, pid: int, args: argparse.Namespace) -> tuple[Counts, Record]:
    """The load and the observer side by side; at the end a last sample and a last snapshot (top 40)."""
    import aiohttp
    counts, record, done = Counts(), Record(), asyncio.Event()
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as session:
        observer = asyncio.create_task(observe(session, url, pid, args, counts, record, start, done))
        await drive(session, url, args.rate, args.minutes * 60.0, args.seed, counts)
        done.set()
        await observer
        record.samples.append(await take_sample(session, url, pid, time.monotonic() - start, counts))
        await snapshot(session, url, record.samples[-1].t_s, record, 40)
    return counts, record


# ------------------------------------------------------------------------------------------- the run


def summarize(counts: Counts, record: Record, args: argparse.Namespace) -> dict:
    samples = record.samples
    first_after_baseline = next((s for s in samples if record.baseline and s.t_s >= record.baseline["t_s"]), None)
    last = samples[-1] if samples else None
    final = record.snapshots[-1] if record.snapshots else {}
    return {
        "minutes": args.minutes, "rate_per_s": args.rate, "trace_frames": args.trace_frames,
        "num_sent": counts.sent, "num_errors": counts.errors, "num_refused_as_asked": counts.refused,
        "error_kinds": counts.error_kinds,
        "rss_mib": {"first": samples[0].rss_mib if samples else None,
                    "at_baseline": first_after_baseline.rss_mib if first_after_baseline else None,
                    "last": last.rss_mib if last else None,
                    "max": max((s.rss_mib for s in samples if s.rss_mib is not None), default=None)},
        "traced_mib": {"at_baseline": first_after_baseline.traced_mib if first_after_baseline else None,
                       "last": last.traced_mib if last else None},
        "slopes": window_slopes(samples),
        "gateway_cpu_s": last.gateway_cpu_s if last else None,
        "growth_since_baseline": final.get("growth", []),
        "baseline_age_s": final.get("baseline_age_s"),
    }


def report(counts: Counts, record: Record, args: argparse.Namespace) -> dict:
    summary = summarize(counts, record, args)
    print(f"\nGateway memory soak: {args.minutes:g} min at {args.rate:g} req/s, {counts.sent} requests, "
          f"{counts.errors} errors, {counts.refused} refused as asked (unknown models)\n")
    print(format_table(record.samples))
    slopes = summary["slopes"]
    if slopes:
        fmt = lambda v: "-" if v is None else f"{v:+.2f}"  # noqa: E731
        print(f"\nslope {_clock(slopes['from_s'])}-{_clock(slopes['to_s'])}: RSS {fmt(slopes['rss_mib_per_h'])} "
              f"MiB/h, traced {fmt(slopes['traced_mib_per_h'])} MiB/h")
    for snap in record.snapshots:  # what a full collection would have freed at each look
        if "garbage" in snap:
            garbage = snap["garbage"]
            kinds = ", ".join(f"{t['type'].rsplit('.', 1)[-1]} {t['num_objects']}" for t in garbage["types"][:4])
            free_lists = garbage.get("free_lists_bytes")
            print(f"  garbage at {_clock(snap['t_s'])}: {garbage['bytes'] / MIB:5.1f} MiB in "
                  f"{garbage['num_objects']} objects ({kinds or 'none'})"
                  + ("" if free_lists is None else f"; free lists {free_lists / MIB:.1f} MiB"))
    if summary["growth_since_baseline"]:
        print(f"\nsites that grew most over the last {summary['baseline_age_s'] / 60:.0f} min (tracemalloc):")
        for site in summary["growth_since_baseline"][:15]:
            print(f"  {site['size_diff_bytes'] / 1024:+9.1f} KiB {site['num_blocks_diff']:+8d} blocks  {site['site']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "baseline": record.baseline,
                               "samples": [asdict(s) for s in record.samples], "snapshots": record.snapshots},
                              indent=1))
    print(f"wrote {out}")
    return summary


def gateway_log(args: argparse.Namespace) -> Path:
    """Beside the JSON: soak_gateway.json -> soak_gateway.gateway.log."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_suffix(".gateway.log")


def run(args: argparse.Namespace) -> None:
    import uvloop
    WORK.mkdir(parents=True, exist_ok=True)
    fleet = start_fleet(2, args.kv_tokens, args.prefill_tokens_per_s)
    tracing = {"PYTHONTRACEMALLOC": str(args.trace_frames)} if args.trace_frames else {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with mock.patch.dict(os.environ, tracing):  # the router inherits it (routing_fleet.checkout_env)
                proc, url = start_router("kvgate:cache_aware", fleet, Path(tmp), gateway_log(args))
            try:
                uvloop.run(_ready(url, proc))
                print(f"gateway pid {proc.pid} at {url}, replicas {', '.join(fleet.urls)}; "
                      f"{args.minutes:g} min at {args.rate:g} req/s", flush=True)
                counts, record = uvloop.run(soak(url, proc.pid, args))
            finally:
                stop_router(proc)
    finally:
        fleet.stop()
    report(counts, record, args)


async def _ready(url: str, proc) -> None:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, url, proc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=95.0,
                   help="how long the load runs (default: 95: the dashboard's hour of history fills, then the "
                        "slope's 30 minutes)")
    p.add_argument("--rate", type=float, default=35.0, help="requests per second offered, open loop (default: 35)")
    p.add_argument("--sample-s", type=float, default=10.0,
                   help="seconds between RSS / traced samples (default: 10)")
    p.add_argument("--baseline-s", type=float, default=None,
                   help="when the tracemalloc baseline is taken, seconds in (default: 3720, past the hour the "
                        "dashboard's history takes to fill, or a third of a shorter run)")
    p.add_argument("--snapshot-s", type=float, default=600.0,
                   help="seconds between tracemalloc snapshots after the baseline (default: 600)")
    p.add_argument("--trace-frames", type=int, default=1,
                   help="PYTHONTRACEMALLOC for the gateway: frames per trace; 0 runs it untraced (default: 1)")
    p.add_argument("--kv-tokens", type=int, default=32_768,
                   help="each replica's KV cache in tokens; the gateway sizes each replica's prefix index from it "
                        "(32,768 x ~4 chars per token / 128-char chunks = ~1,024 chunks) (default: 32768)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=200_000.0,
                   help="each replica's prefill speed (default: 200000, so it never queues at 35 req/s)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (default: 0)")
    p.add_argument("--out", default=str(WORK / "soak_gateway.json"),
                   help="where the JSON goes (default: loadtests/.work/soak_gateway.json)")
    args = p.parse_args(argv)
    if args.baseline_s is None:
        args.baseline_s = min(3720.0, args.minutes * 60.0 / 3)
    run(args)


if __name__ == "__main__":
    main()
