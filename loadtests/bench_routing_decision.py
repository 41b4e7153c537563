"""Routing decision cost per request at N replicas: what `Proxy._decide` spends before any byte moves.

One process, no sockets. For each fleet size, a `ReplicaTracker` with N static replicas replays the
hot_prefix workload's prompts in order, as the gateway would: view the model's replicas, `choose`, record
the chain, start the attempt (the oldest attempts end, so about 6 per replica stay in flight and every
decision sees a replica or two changed since the last). Two sides, on the same requests:

  kvgate        `tracker.view(model)`: replica states kept until a record changes, replicas kept sorted
  rebuilt       every replica's state built anew and sorted for every request (the gateway before 2026-11-21)

Timed: the view and `choose` together, per request (the median of --repeats passes).

    .venv/bin/python loadtests/bench_routing_decision.py
    .venv/bin/python loadtests/bench_routing_decision.py --replicas 16 256 --requests 400

Prints a table and writes JSON to loadtests/.work/bench_routing_decision.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvgate.clock import RealClock  # noqa: E402
from loadtests import workloads  # noqa: E402
from kvgate.registry.loader import load_registry  # noqa: E402
from kvgate.router.features import RouteRequest, build_route_request  # noqa: E402
from kvgate.router.policies import RoutingKnobs, choose  # noqa: E402
from kvgate.router.replicas import ReplicaTracker  # noqa: E402
from kvgate.router.view import ReplicaView  # noqa: E402

WORK = REPO / "loadtests" / ".work"
MODEL = "m"
IN_FLIGHT_PER_REPLICA = 6


def write_registry(directory: Path, num_replicas: int) -> None:
    # Unroutable documentation addresses: nothing here connects (the replay never yields to the loop).
    static = ", ".join(f"{{url: 'http://192.0.2.{i // 250}:{8000 + i % 250}', backend: openai}}"
                       for i in range(num_replicas))
    (directory / "models.yaml").write_text(
        f"apiVersion: kvgate/v1\nkind: Model\nmetadata: {{name: {MODEL}}}\nspec:\n  source: builtin:tiny-llama\n"
        f"  routing:\n    static_replicas: [{static}]\n")


def kept_view(tracker: ReplicaTracker, model: str) -> ReplicaView:
    return tracker.view(model)


def rebuilt_view(tracker: ReplicaTracker, model: str) -> ReplicaView:
    """The view as the gateway built it before: every state anew, then sorted."""
    records = [r for r in tracker._replicas.values() if r.model == model]  # noqa: SLF001 - the baseline
    states = (r._build_state() for r in records)  # noqa: SLF001
    return ReplicaView.of(states, tracker.prefixes, tracker.in_flight_chains)


async def replay(num_replicas: int, routes: list[RouteRequest], knobs: RoutingKnobs,
                 view_of: Callable[[ReplicaTracker, str], ReplicaView]) -> tuple[float, list[str]]:
    """Seconds per request spent in the view and `choose`, and the replica chosen for each request."""
    with tempfile.TemporaryDirectory() as directory:
        write_registry(Path(directory), num_replicas)
        snapshot = load_registry(Path(directory))
    tracker = ReplicaTracker(clock=RealClock())
    tracker.update_registry(snapshot)
    leases: collections.deque = collections.deque()
    spent_s, chosen = 0.0, []
    try:
        for route in routes:
            started = time.perf_counter()
            decision = choose(route, view_of(tracker, MODEL), knobs)
            spent_s += time.perf_counter() - started
            assert decision.replica_id is not None
            chosen.append(decision.replica_id)
            tracker.prefixes.record(decision.replica_id, route.prefix_hashes)
            leases.append(tracker.start_attempt(decision.replica_id, route.prefix_hashes,
                                                route.uncached_tokens(decision.predicted_match_chunks)))
            if len(leases) > IN_FLIGHT_PER_REPLICA * num_replicas:
                leases.popleft().end()
    finally:
        await tracker.close()
    return spent_s / len(routes), chosen


def make_routes(num_requests: int, chunk_chars: int, affinity_depth_chars: int) -> list[RouteRequest]:
    requests = workloads.hot_prefix(MODEL, num_bursts=max(1, num_requests // 100), burst_gap_s=2.0)[:num_requests]
    return [build_route_request({"model": r.model, "messages": list(r.messages)}, MODEL,
                                None if r.model == MODEL else r.model, chunk_chars, seq, chars_per_token=4.0,
                                affinity_depth_chars=affinity_depth_chars)
            for seq, r in enumerate(requests)]


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        write_registry(Path(directory), 1)
        routing = load_registry(Path(directory)).models[MODEL].spec.routing
    knobs = RoutingKnobs.from_routing(routing)
    routes = make_routes(args.requests, routing.prefix_chunk_chars, routing.affinity_depth_chars)
    rows = []
    for n in args.replicas:
        sides: dict[str, list[float]] = {"kvgate": [], "rebuilt": []}
        for _ in range(args.repeats):  # alternating, so both sides see the same box
            for side, view_of in (("kvgate", kept_view), ("rebuilt", rebuilt_view)):
                sides[side].append((await replay(n, routes, knobs, view_of))[0])
        ours, before = statistics.median(sides["kvgate"]) * 1e6, statistics.median(sides["rebuilt"]) * 1e6
        rows.append({"replicas": n, "kvgate_us": ours, "rebuilt_us": before, "ratio": ours / before})
        print(f"  {n:4d} replicas: {ours:8.1f} us vs {before:8.1f} us", file=sys.stderr)
    return {"requests": len(routes), "repeats": args.repeats, "workload": "hot_prefix", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=800, help="hot_prefix requests replayed per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(WORK / "bench_routing_decision.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"\nRouting decision per request (view + choose, median of {args.repeats}; hot_prefix, "
          f"{result['requests']} requests)\n")
    print(f"{'replicas':>8s} {'kvgate us':>10s} {'rebuilt us':>11s} {'ratio':>6s}")
    for row in result["rows"]:
        print(f"{row['replicas']:8d} {row['kvgate_us']:10.1f} {row['rebuilt_us']:11.1f} {row['ratio']:5.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
