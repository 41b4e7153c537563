"""Routing under a fault: one replica SIGKILLed mid-run, kvgate's cache_aware vs sglang-router and vllm-router.

Each router gets 4 fresh simulated replicas (`sim_replica.py`, one process per replica, sized from the
workload as in `bench_routing.py`) and the hot-prefix workload (bursts of ~100 concurrent streamed chat
requests, 55% on one long system prompt). `--kill-at-s` seconds into the replay (by default 0.1 s after
a burst starts, while its streams are open) the replica that has served the most requests so far (with
cache-aware routing, the hot prefix's home) is SIGKILLed: no drain, its connections reset.

Every failed request is classed by what the client had seen:
- failed before any streamed byte: an HTTP error status, or a connection that ended before the first SSE
  event (kvgate's target: 0, since a retry before the first byte goes to another replica);
- broken mid-stream: some SSE events arrived, then the stream broke; `with SSE error event` counts those
  whose stream ended with an `error` event (kvgate's contract) rather than a bare cut.

    .venv/bin/python loadtests/bench_routing_faults.py                 # kvgate, sglang-router, vllm-router
    .venv/bin/python loadtests/bench_routing_faults.py --bursts 4 --kill-at-s 2.1 --routers kvgate:cache_aware

Prints a table and writes loadtests/.work/bench_routing_faults.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from loadtests import workloads  # noqa: E402
from loadtests.bench_routing import (MODEL, WORK, one_request, router_decisions, routes_on, summarize,  # noqa: E402
                                     wait_ready)
from loadtests.routing_fleet import (  # noqa: E402
    Fleet,
    replica_counters,
    router_available,
    start_fleet,
    start_router,
    stop_router,
)

ROUTERS = ("kvgate:cache_aware", "sglang:cache_aware", "vllm-router:cache_aware")


def classify(results: list[dict]) -> dict[str, int]:
    """Failed requests split by what the client saw before the failure."""
    failed = [r for r in results if not r["ok"]]
    mid = [r for r in failed if r["streamed"]]
    return {"failed": len(failed), "failed_before_first_byte": len(failed) - len(mid),
            "broken_mid_stream": len(mid), "broken_with_sse_error_event": sum(r["error_event"] for r in mid)}


async def killer(session, fleet: Fleet, t0: float, kill_at_s: float, out: dict) -> None:
    """At t0 + kill_at_s, SIGKILL the replica that has served the most requests so far."""
    await asyncio.sleep(max(0.0, t0 + kill_at_s - time.perf_counter()))
    counts = await replica_counters(session, fleet)
    index = max(range(len(counts)), key=lambda i: (counts[i] or {}).get("num_requests", -1))
    # The kill blocks for the process to exit (milliseconds): do it off the loop so streams keep flowing.
    pid = await asyncio.to_thread(fleet.kill, index)
    out.update({"killed_replica": fleet.urls[index], "killed_pid": pid, "killed_at_s": time.perf_counter() - t0,
                "requests_served_before_kill": [c and c["num_requests"] for c in counts]})


async def run_once(url: str, proc, fleet: Fleet, reqs: list[workloads.Request], kill_at_s: float,
                   timeout_s: float) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_ready(session, url, proc, engines=bool(fleet.grpc_targets))  # peers answer at once
        before = await replica_counters(session, fleet)
        t0 = time.perf_counter() + 0.2
        kill: dict = {}
        kill_task = asyncio.create_task(killer(session, fleet, t0, kill_at_s, kill))
        results = await asyncio.gather(*(one_request(session, url, r, t0, timeout_s) for r in reqs))
        await kill_task
        after = await replica_counters(session, fleet)
        decisions = await router_decisions(session, url)
        on = await routes_on(session, url)
    res = summarize(results, before, after, decisions, t0, len(reqs)) | {"routes_on": on}
    res |= classify(results) | kill
    # Requests sent after the kill: do they still fail (retries into the dead replica) or not?
    late = [r for r in results if r["sent"] > kill["killed_at_s"] + 1.0]
    res["failed_sent_1s_after_kill"] = sum(not r["ok"] for r in late)
    res["num_sent_1s_after_kill"] = len(late)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--routers", nargs="+", default=list(ROUTERS))
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--burst-gap-s", type=float, default=2.0)
    p.add_argument("--kill-at-s", type=float, nargs="+", default=[4.1, 4.6],
                   help="seconds into the replay, one run per value (a burst starts every --burst-gap-s seconds: "
                        "0.1 s in, its requests are mostly queued or in prefill; 0.6 s in, many are streaming)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--sim-kv-events", action="store_true",
                   help="the sims also speak kvgate's replica-state protocol, so kvgate routes on their KV block "
                        "events (as bench_routing.py --sim-kv-events); the killed replica's stream drops with it")
    p.add_argument("--out", type=Path, default=WORK / "bench_routing_faults.json")
    args = p.parse_args(argv)
    n = 4
    reqs = workloads.hot_prefix(MODEL, args.bursts, args.burst_gap_s)
    info = workloads.summary(reqs)
    kv_tokens = max(2048, int(info["unique_tokens"] / n))
    prefill_tps = info["prompt_tokens"] / max(1.0, info["span_s"]) / n  # --load 1.0, as bench_routing
    print(f"hot_prefix: {len(reqs)} requests over {info['span_s']:.1f} s on {n} simulated replicas "
          f"(KV {kv_tokens} tokens, prefill {prefill_tps:.0f} tok/s); SIGKILL the busiest at {args.kill_at_s} s",
          flush=True)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "workload_summary": info, "results": {},
           "skipped": {}}
    WORK.mkdir(parents=True, exist_ok=True)
    for kill_at_s, name in ((t, name) for t in args.kill_at_s for name in args.routers):
        why = router_available(name)
        if why:
            out["skipped"][name] = why
            print(f"  {name}: skipped, {why}", flush=True)
            continue
        fleet = start_fleet(n, kv_tokens, prefill_tps, kv_events=args.sim_kv_events)
        with tempfile.TemporaryDirectory() as tmp:
            log = WORK / f"bench_routing_faults-{name.replace(':', '-')}.log"
            proc, url = start_router(name, fleet, Path(tmp), log)
            try:
                res = asyncio.run(run_once(url, proc, fleet, reqs, kill_at_s, args.timeout_s))
            finally:
                stop_router(proc)
                fleet.stop()
        res["router"] = name
        out["results"][f"{name} @ {kill_at_s:g} s"] = res
        print(f"  {name}: killed {res['killed_replica']} at {res['killed_at_s']:.2f} s; failed {res['failed']} "
              f"(before first byte {res['failed_before_first_byte']}, mid-stream {res['broken_mid_stream']}); "
              f"errors {res['errors']}", flush=True)
        args.out.write_text(json.dumps(out, indent=2))
    print_table(out)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


def print_table(out: dict) -> None:
    print("\n| router @ kill time | requests | failed before any streamed byte | broken mid-stream | ... with SSE error event "
          "| failed, sent > 1 s after the kill | p99 TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in out["results"].items():
        p99 = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s'] * 1000:.0f}"
        print(f"| {name} | {r['num_requests']} | {r['failed_before_first_byte']} | {r['broken_mid_stream']} "
              f"| {r['broken_with_sse_error_event']} | {r['failed_sent_1s_after_kill']} of "
              f"{r['num_sent_1s_after_kill']} | {p99} |")
    for name, why in out["skipped"].items():
        print(f"| {name} | skipped: {why} |")


if __name__ == "__main__":
    main()
