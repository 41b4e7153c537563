"""Two kvgate gateways that share no state: do they still send repeated prefixes to the same replica?

Two `kvgate router` processes (no --state: each has only its own prefix index and in-flight counts) front
the same 4 fresh simulated replicas (`sim_replica.py`, sized from the workload as in `bench_routing.py`);
the client sends each request to one of the two at random (seeded). For comparison the same replay runs
through one gateway on fresh replicas.

A request "repeats a prefix" when an earlier request for the same model (adapter) shares at least half of
its prompt text as a common prefix: the hot system prompt, a later turn of a conversation, a trace prompt
whose first half was seen before. Its "previous" request is the most recent such one (in send order).
Measured, from the gateway's x-kvgate-replica header: the share of repeating requests sent to a replica
that an earlier request with the same prefix went to, through either gateway ("to a replica holding the
prefix": the gateways agree on where a prefix lives; target with two gateways >= 95%), also weighted by
the characters each one shares with its previous request (what going elsewhere puts at stake: the
trace's short prompts whose 200-character opening repeats count for less than a long conversation); the stricter share
on the same replica as their previous request (the load bound spreads a hot prefix over several holders
by design, so this is low even with one gateway); and the replicas' prompt-token hit rate, two gateways
vs one.

    .venv/bin/python loadtests/bench_routing_gateways.py
    .venv/bin/python loadtests/bench_routing_gateways.py --workloads mooncake --policy cache_aware
    .venv/bin/python loadtests/bench_routing_gateways.py --engines    # 4 real kvgate engines instead
    .venv/bin/python loadtests/bench_routing_gateways.py --sim-kv-events    # sims streaming KV block events

With --engines the replicas are four `kvgate engine` processes on builtin:tiny-llama, sized and with the
workloads scaled as `bench_routing.py --engines` does. The gateways then route on the engines' KV block
events (what each engine says it holds, read by every gateway), where against simulated replicas each
gateway has only its own index of what it sent. With --sim-kv-events the 4 sims run in KV-events mode
(`sim_state.py`: SmolLM2-135M's tokenizer, the replica-state protocol), sized as without it, and the
gateways route them on their KV block events as they do real engines.

Prints a table and writes loadtests/.work/bench_routing_gateways.json.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from loadtests import workloads  # noqa: E402
from loadtests.bench_routing import (MODEL, WORK, engine_sizes, make_workload, one_request, router_decisions,  # noqa: E402
                                     routes_on, sim_token_replay, summarize, wait_ready)
from loadtests.routing_fleet import (replica_counters, start_engine_fleet, start_fleet, start_router,  # noqa: E402
                                     stop_router)


def previous_with_prefix(reqs: list[workloads.Request]) -> list[int | None]:
    """For each request (in the given order), the index of the latest earlier request for the same model
    whose prompt shares at least half of this prompt as a common prefix; None when there is none."""
    texts = [r.prompt_text() for r in reqs]
    out: list[int | None] = []
    for i, r in enumerate(reqs):
        need = len(texts[i]) // 2
        found = None
        for j in range(i - 1, -1, -1):
            if reqs[j].model == r.model and texts[j][:need] == texts[i][:need]:
                found = j
                break
        out.append(found)
    return out


def same_replica_share(results: list[dict], prev: list[int | None]) -> dict:
    """Of the requests that repeat a prefix (and whose previous request was answered), the share on the
    same replica as that previous one, overall and by request kind."""
    by_kind: dict[str, list[int]] = {}
    for i, j in enumerate(prev):
        if j is None or results[i]["replica"] is None or results[j]["replica"] is None:
            continue
        same, total = by_kind.setdefault(results[i]["kind"], [0, 0])
        by_kind[results[i]["kind"]] = [same + (results[i]["replica"] == results[j]["replica"]), total + 1]
    same = sum(v[0] for v in by_kind.values())
    total = sum(v[1] for v in by_kind.values())
    return {"repeated_prefix_requests": total, "same_replica": same, "share": same / total if total else None,
            "by_kind": {k: {"same": s, "total": t, "share": s / t} for k, (s, t) in by_kind.items()}}


def earlier_with_prefix(reqs: list[workloads.Request]) -> list[list[int]]:
    """For each request, every earlier request (same model) sharing at least half of its prompt as a
    common prefix: where that prefix has been sent so far."""
    texts = [r.prompt_text() for r in reqs]
    out: list[list[int]] = []
    for i, r in enumerate(reqs):
        need = len(texts[i]) // 2
        out.append([j for j in range(i) if reqs[j].model == r.model and texts[j][:need] == texts[i][:need]])
    return out


def common_prefix_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    return len(os.path.commonprefix([a, b]))


def repeated_prefix_chars(reqs: list[workloads.Request], prev: list[int | None]) -> list[int]:
    """For each request, the characters it shares as a common prefix with its previous request (0 when it
    repeats nothing): what sending it away from a holder puts at stake."""
    texts = [r.prompt_text() for r in reqs]
    return [0 if j is None else common_prefix_chars(texts[i], texts[j]) for i, j in enumerate(prev)]


def home_replica_share(results: list[dict], earlier: list[list[int]], weights: list[int] | None = None) -> dict:
    """Of the requests that repeat a prefix, the share sent to a replica that some earlier request with
    that prefix went to (through either gateway): the gateways agree on where the prefix lives. Unlike
    `same_replica_share` this does not count it against the router when the load bound spreads a hot
    prefix over several replicas that all hold it. With `weights` (`repeated_prefix_chars`), also the
    share weighted by each request's repeated prefix: a 200-character opening sent elsewhere counts for
    less than a 20,000-character conversation."""
    by_kind: dict[str, list[int]] = {}
    chars = [0, 0]  # repeated prefix characters sent to a home, in all
    for i, js in enumerate(earlier):
        homes = {results[j]["replica"] for j in js if results[j]["replica"] is not None}
        if not homes or results[i]["replica"] is None:
            continue
        at_home = results[i]["replica"] in homes
        hit, total = by_kind.setdefault(results[i]["kind"], [0, 0])
        by_kind[results[i]["kind"]] = [hit + at_home, total + 1]
        if weights is not None:
            chars = [chars[0] + at_home * weights[i], chars[1] + weights[i]]
    hit = sum(v[0] for v in by_kind.values())
    total = sum(v[1] for v in by_kind.values())
    out = {"repeated_prefix_requests": total, "to_a_home": hit, "share": hit / total if total else None,
           "by_kind": {k: {"to_a_home": h, "total": t, "share": h / t} for k, (h, t) in by_kind.items()}}
    if weights is not None:
        out |= {"repeated_prefix_chars": chars[1], "chars_to_a_home": chars[0],
                "chars_share": chars[0] / chars[1] if chars[1] else None}
    return out


async def replay(urls: list[str], procs: list, fleet, reqs: list[workloads.Request], seed: int,
                 timeout_s: float, extra_body: dict | None = None, kv_blocks: bool = False) -> tuple[list[dict], dict]:
    import aiohttp

    rng = random.Random(seed)
    pick = [rng.randrange(len(urls)) for _ in reqs]  # fixed per seed: the same split for every run
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url, proc in zip(urls, procs):
            await wait_ready(session, url, proc, engines=kv_blocks)
        before = await replica_counters(session, fleet)
        t0 = time.perf_counter() + 0.2
        results = await asyncio.gather(*(one_request(session, urls[k], r, t0, timeout_s, extra_body)
                                         for k, r in zip(pick, reqs)))
        after = await replica_counters(session, fleet)
        decisions = [await router_decisions(session, url) for url in urls]  # each gateway's, by reason
        on = [await routes_on(session, url) for url in urls]
    res = summarize(results, before, after, {}, t0, len(reqs))
    res["router_decisions"] = decisions
    res["routes_on"] = on
    return results, res


def run(workload: str, reqs: list[workloads.Request], gateways: int, args: argparse.Namespace,
        best: float) -> dict:
    n = 4
    extra_body, chunk_chars = None, 128
    if args.engines:  # sized as bench_routing.py --engines
        fleet = start_engine_fleet(n, engine_sizes(reqs, n, 1.0)["kv_cache_bytes"])
        extra_body, chunk_chars = {"ignore_eos": True, "temperature": 0}, 32
    else:
        info = workloads.summary(reqs)
        kv_tokens = max(2048, int(info["unique_tokens"] / n))
        prefill_tps = info["prompt_tokens"] / max(1.0, info["span_s"]) / n
        fleet = start_fleet(n, kv_tokens, prefill_tps, kv_events=args.sim_kv_events)
    procs, urls = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for g in range(gateways):
                d = Path(tmp) / f"g{g}"
                d.mkdir()
                extra = args.set + (["kv_events: false"] if args.text_index else [])
                proc, url = start_router(f"kvgate:{args.policy}", fleet, d,
                                         WORK / f"bench_routing_gateways-{g}.log", chunk_chars, ", ".join(extra))
                procs.append(proc)
                urls.append(url)
            results, res = asyncio.run(replay(urls, procs, fleet, reqs, args.seed, args.timeout_s, extra_body,
                                              kv_blocks=(args.engines or args.sim_kv_events) and not args.text_index))
    finally:
        for proc in procs:
            stop_router(proc)
        fleet.stop()
    prev = previous_with_prefix(reqs)
    res["same_replica"] = same_replica_share(results, prev)
    res["home_replica"] = home_replica_share(results, earlier_with_prefix(reqs), repeated_prefix_chars(reqs, prev))
    res["gateways"] = gateways
    print(f"  {workload}, {gateways} gateway(s): same replica {res['same_replica']['same_replica']}/"
          f"{res['same_replica']['repeated_prefix_requests']}, to a replica holding the prefix "
          f"{res['home_replica']['to_a_home']}/{res['home_replica']['repeated_prefix_requests']} "
          f"({res['home_replica']['chars_share']:.3f} by prefix characters), "
          f"hit {res['hit_rate']:.3f} ({res['hit_rate'] / best if best else 0:.3f} of best), failed "
          f"{res['num_failed']}, routing on {res['routes_on']}", flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["hot_prefix", "mooncake"], choices=["hot_prefix", "mooncake"])
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--bursts", type=int, default=6)
    p.add_argument("--burst-gap-s", type=float, default=2.0)
    p.add_argument("--mooncake-requests", type=int, default=600)
    p.add_argument("--speedup", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0, help="which gateway each request goes to")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--engines", action="store_true",
                   help="4 real kvgate engines (builtin:tiny-llama) instead of simulated replicas")
    p.add_argument("--sim-kv-events", action="store_true",
                   help="4 simulated replicas in KV-events mode (they stream KV block events like kvgate engines)")
    p.add_argument("--text-index", action="store_true",
                   help="with --engines or --sim-kv-events: registry routing.kv_events false, so each gateway routes "
                        "on its own index of what it sent (the control for the replicas' KV block events)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD: VALUE",
                   help="a registry routing field for both gateways, e.g. --set 'miss_cost_weight: 32' (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="default loadtests/.work/bench_routing_gateways.json (-engines.json with --engines, "
                        "-sim-kv.json with --sim-kv-events, -text before .json with --text-index)")
    args = p.parse_args(argv)
    if args.engines and args.sim_kv_events:
        p.error("--sim-kv-events is for simulated replicas; real engines (--engines) always stream KV events")
    if args.out is None:
        kind = "-engines" if args.engines else "-sim-kv" if args.sim_kv_events else ""
        args.out = WORK / f"bench_routing_gateways{kind}{'-text' if args.text_index and kind else ''}.json"
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "cells": []}
    for workload in args.workloads:
        reqs = make_workload(workload, False, args)  # engine-scaled texts with --engines
        best = (engine_sizes(reqs, 4, 1.0)["best_hit_rate"] if args.engines else
                sim_token_replay(reqs)["best_hit_rate"] if args.sim_kv_events else  # the sims count real tokens
                workloads.infinite_cache_hit_rate(reqs))
        cell = {"workload": workload, "workload_summary": workloads.summary(reqs), "mode": "engines" if args.engines
                else "sim-kv-events" if args.sim_kv_events else "sim", "infinite_cache_hit_rate": best, "results": {}}
        for gateways in (2, 1):
            cell["results"][str(gateways)] = run(workload, reqs, gateways, args, best)
        out["cells"].append(cell)
        args.out.write_text(json.dumps(out, indent=2))
    print_table(out)
    print(f"\nwrote {args.out} ({os.cpu_count()} CPUs)")


def print_table(out: dict) -> None:
    print("\n| workload | gateways | repeated-prefix requests | to a replica holding the prefix | the same, by "
          "prefix characters | same replica as previous | by kind (same as previous) | hit rate | hit / best "
          "| p99 TTFT ms | failed |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for cell in out["cells"]:
        best = cell["infinite_cache_hit_rate"]
        for g, r in cell["results"].items():
            s = r["same_replica"]
            kinds = " / ".join(f"{k} {v['share']:.3f}" for k, v in sorted(s["by_kind"].items()))
            p99 = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s'] * 1000:.0f}"
            share = "-" if s["share"] is None else f"{s['share']:.3f}"
            home, home_chars = (r.get("home_replica", {}).get(k) for k in ("share", "chars_share"))
            home_s, chars_s = ("-" if v is None else f"{v:.3f}" for v in (home, home_chars))
            print(f"| {cell['workload']} | {g} | {s['repeated_prefix_requests']} | {home_s} | {chars_s} | {share} "
                  f"| {kinds} "
                  f"| {r['hit_rate']:.3f} | {r['hit_rate'] / best if best else 0:.3f} | {p99} | {r['num_failed']} |")


if __name__ == "__main__":
    main()
