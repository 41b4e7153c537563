"""A deterministic, in-process replay of a routing policy over simulated replicas: seconds, not minutes.

`bench_routing.py` runs the real gateway process in front of real simulated-replica servers on the wall
clock, which is what the published numbers come from, and single runs of it move by ~0.04 of hit rate
and ~40% of p99 on this shared box. This replay runs the same pieces without sockets or a clock: the
workloads (`workloads.py`), the replica cost model (`sim_replica_model.Scheduler`, sized as the bench
sizes it) and the router's own pure parts (`build_route_request`, `PrefixIndexes`, `policies.choose`)
on a discrete-event timeline, so two policy variants compare on identical timing. Use it to explore;
quote the bench.

What it leaves out, on purpose: HTTP and event-loop delays, the engine's load report being up to a poll
old (here it is fresh), and learning characters per token (the sim's 4 is given).

    .venv/bin/python loadtests/routing_replay.py --workload mooncake --replicas 16
    .venv/bin/python loadtests/routing_replay.py --workload hot_prefix --replicas 4 --set miss_cost_weight=1
    .venv/bin/python loadtests/routing_replay.py --workload mooncake --policy oracle     # or: sglang
    .venv/bin/python loadtests/routing_replay.py --workload mooncake --replicas 4 --gateways 2 --mooncake-requests 600
    .venv/bin/python loadtests/routing_replay.py --workload mooncake --floor   # the TTFT no router can beat

Each line printed is one cell as JSON: hit rate over the infinite-cache best, p50 / p99 TTFT, max/mean
requests per replica, decisions by reason, and with --gateways > 1 the two-gateway bench's agreement figure.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests import workloads  # noqa: E402
from loadtests.common import percentile  # noqa: E402
from loadtests.sim_replica_model import (BLOCK_SIZE_TOKENS, CHARS_PER_TOKEN, Scheduler, SchedulerSpec,  # noqa: E402
                                         SimSequence, block_hashes, num_prompt_tokens)
from kvgate.registry.schema import Routing  # noqa: E402
from kvgate.router.features import RouteRequest, build_route_request  # noqa: E402
from kvgate.router.common_openings import CommonOpenings  # noqa: E402
from kvgate.router.policies import PolicyFn, Reason, RouteDecision, RoutingKnobs, choose  # noqa: E402
from kvgate.router.prefix_index import PrefixIndexes, capacity_chunks  # noqa: E402
from kvgate.router.view import ChainHold, InFlightChains, ReplicaState, ReplicaView  # noqa: E402

MODEL = "sim-llama"
CHUNK_CHARS = 128  # what bench_routing gives kvgate in sim mode


@dataclass
class _Replica:
    replica_id: str
    scheduler: Scheduler
    busy: bool = False
    served: int = 0


@dataclass
class _Gateway:
    """What one gateway knows: its own prefix indexes, and its own requests in flight (with their prefix
    chains) and pending prefill per replica. Gateways share nothing; the replicas' own queue counts are
    seen by all (fresh here)."""

    indexes: PrefixIndexes
    openings: CommonOpenings = field(default_factory=CommonOpenings)
    in_flight: dict[str, int] = field(default_factory=dict)
    pending_prefill_tokens: dict[str, int] = field(default_factory=dict)
    in_flight_chains: InFlightChains = field(default_factory=InFlightChains)


@dataclass
class _Pending:
    arrived_s: float
    gateway: _Gateway
    replica_id: str
    prefill_tokens: int
    route: RouteRequest
    predicted_chunks: int
    chains: ChainHold
    ttft_s: float | None = None
    cached_tokens: int | None = None  # what the replica reports as usage.cached_tokens


@dataclass
class ReplayResult:
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    max_over_mean_load: float
    decisions: dict[str, int] = field(default_factory=dict)
    ttft_by_request: dict[int, float] = field(default_factory=dict)  # index in the request list -> seconds
    replica_by_request: dict[int, str] = field(default_factory=dict)
    cached_by_request: dict[int, int] = field(default_factory=dict)  # prompt tokens its replica served from cache
    index_capacity_chunks: dict[str, int] = field(default_factory=dict)  # the first gateway's indexes


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class SglangLike:
    """An approximation of sglang-router 0.3's `cache_aware`, for side-by-side replays: shortest queue when
    in-flight counts differ by more than 64 and 1.5x; else the longest match when it covers more than half
    the prompt; else the replica sent the least new text ("smallest tree"). Its tree never forgets here
    (its default limit is far above these workloads) and matches in whole chunks, not characters. One
    instance per replay: it counts the text it has sent."""

    def __init__(self) -> None:
        self.text_sent: dict[str, int] = {}  # replica -> chunks sent that it did not hold

    def __call__(self, route: RouteRequest, view: ReplicaView, knobs: RoutingKnobs) -> RouteDecision:
        candidates = view.candidates(route.model)
        held = {r.replica_id: view.match_length(r.replica_id, route.prefix_hashes) for r in candidates}
        loads = [r.in_flight for r in candidates]
        if max(loads) - min(loads) > 64 and max(loads) > 1.5 * min(loads):
            chosen, reason = min(candidates, key=lambda r: r.in_flight), Reason.LEAST_LOAD
        else:
            best = max(candidates, key=lambda r: held[r.replica_id])
            if held[best.replica_id] * route.chunk_chars > 0.5 * route.num_prompt_chars:
                chosen, reason = best, Reason.PREFIX_HIT
            else:
                chosen = min(candidates, key=lambda r: self.text_sent.get(r.replica_id, 0))
                reason = Reason.NEW_TEXT
        rid = chosen.replica_id
        self.text_sent[rid] = self.text_sent.get(rid, 0) + len(route.prefix_hashes) - held[rid]
        return RouteDecision(rid, reason, held[rid])


def _oracle(req: workloads.Request, replicas: dict[str, _Replica], knobs: RoutingKnobs) -> RouteDecision:
    """A router that sees every replica's real cache and prefill queue (no request cap): the least
    pending + miss_cost_weight x uncached, in the replicas' own tokens. A bound on what greedy per-request
    placement can do with perfect information, not a policy a gateway could run."""
    text = req.prompt_text()
    tokens, hashes = num_prompt_tokens(text), block_hashes(text, req.model)

    def cost(rep: _Replica) -> tuple[float, str]:
        uncached = tokens - rep.scheduler.cached_tokens_now(tokens, hashes)
        return rep.scheduler.pending_prefill_tokens + knobs.miss_cost_weight * uncached, rep.replica_id

    return RouteDecision(min(replicas.values(), key=cost).replica_id, Reason.PREFIX_HIT, 0)


def replay(reqs: list[workloads.Request], num_replicas: int, spec: SchedulerSpec, knobs: RoutingKnobs,
           affinity_depth_chars: int = 1024, policy: PolicyFn | str = choose, num_gateways: int = 1,
           seed: int = 0, report_kv_size: bool = True) -> ReplayResult:
    """Route every request with `policy` (a policy function, or "oracle") and play the replicas' steps;
    see the module docstring. With several gateways each request goes to one at random (`seed`), as in
    `bench_routing_gateways.py`. Without `report_kv_size` the replicas are servers that report no KV
    size: the gateway's indexes have their default size (prefix_index) and no KV-fit test runs."""
    replicas = {f"r{i:02d}": _Replica(f"r{i:02d}", Scheduler(spec)) for i in range(num_replicas)}
    kv_blocks_total = spec.kv_capacity_tokens // BLOCK_SIZE_TOKENS
    reported_blocks = kv_blocks_total if report_kv_size else 0  # what the replicas' load reports say (0: unknown)
    index_blocks = 1 << 30 if isinstance(policy, SglangLike) else reported_blocks  # sglang's tree: no KV limit
    gateways = [_Gateway(PrefixIndexes(CHUNK_CHARS)) for _ in range(num_gateways)]
    for gateway in gateways:
        for rid in replicas:
            gateway.indexes.ensure(rid, index_blocks, BLOCK_SIZE_TOKENS, CHUNK_CHARS, CHARS_PER_TOKEN)
            gateway.in_flight[rid] = gateway.pending_prefill_tokens[rid] = 0
    rng = random.Random(seed)
    pick = [rng.randrange(num_gateways) for _ in reqs]
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    for i, r in enumerate(reqs):
        heapq.heappush(events, (r.at_s, next(order), "arrive", i))
    pending: dict[int, _Pending] = {}
    decisions: dict[str, int] = {}

    def state(gateway: _Gateway, rep: _Replica) -> ReplicaState:
        used = rep.scheduler.kv_usage()
        rid = rep.replica_id
        return ReplicaState(
            replica_id=rid, url="", model=MODEL, healthy=True, draining=False, in_flight=gateway.in_flight[rid],
            num_waiting=rep.scheduler.num_waiting, num_running=rep.scheduler.num_running,
            kv_blocks_free=int(reported_blocks * (1 - used)), kv_blocks_total=reported_blocks,
            adapters_loaded=frozenset(workloads.ADAPTERS), max_loaded_adapters=len(workloads.ADAPTERS),
            pending_prefill_tokens=gateway.pending_prefill_tokens[rid])

    def kick(rep: _Replica, now: float) -> None:
        if rep.busy:
            return
        plan = rep.scheduler.schedule()
        if plan is not None:
            rep.busy = True
            heapq.heappush(events, (now + plan.duration_s, next(order), "step", (rep.replica_id, plan)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            i = payload
            req = reqs[i]
            gateway = gateways[pick[i]]
            adapter = req.model if req.model in workloads.ADAPTERS else None
            route = build_route_request(req.body(), MODEL, adapter, CHUNK_CHARS, i, CHARS_PER_TOKEN,
                                        affinity_depth_chars)
            route = gateway.openings.stamp(route, knobs.policy)  # as the gateway's handler does
            if policy == "oracle":
                decision = _oracle(req, replicas, knobs)
            else:
                view = ReplicaView.of((state(gateway, rep) for rep in replicas.values()), gateway.indexes,
                                      gateway.in_flight_chains)
                decision = policy(route, view, knobs)
            decisions[decision.reason.value] = decisions.get(decision.reason.value, 0) + 1
            rep = replicas[decision.replica_id]
            gateway.indexes.record(rep.replica_id, route.prefix_hashes)
            prefill = route.uncached_tokens(decision.predicted_match_chunks)
            gateway.in_flight[rep.replica_id] += 1
            gateway.pending_prefill_tokens[rep.replica_id] += prefill
            rep.served += 1
            text = req.prompt_text()
            pending[i] = _Pending(now, gateway, rep.replica_id, prefill, route, decision.predicted_match_chunks,
                                  gateway.in_flight_chains.add(rep.replica_id, route.prefix_hashes))
            rep.scheduler.add(SimSequence(i, req.model, num_prompt_tokens(text), block_hashes(text, req.model),
                                          req.max_tokens))
            kick(rep, now)
        else:
            rid, plan = payload
            rep = replicas[rid]
            rep.busy = False
            cached = {seq_id: rep.scheduler.num_cached_tokens(seq_id) for seq_id, _ in plan.prefill}  # before it ends
            for event in rep.scheduler.complete(plan):
                p = pending[event.seq_id]
                if event.index == 0:
                    p.ttft_s = now - p.arrived_s
                    p.cached_tokens = cached.get(event.seq_id)
                    left = p.gateway.pending_prefill_tokens[rid] - p.prefill_tokens
                    p.gateway.pending_prefill_tokens[rid] = max(0, left)
                if event.finished:
                    p.gateway.in_flight[rid] -= 1
                    p.chains.release()
                    if p.cached_tokens is not None and policy is choose:  # the proxy learns from usage.cached_tokens
                        p.gateway.indexes.correct(rid, p.route.prefix_hashes, p.predicted_chunks, p.cached_tokens,
                                                  CHARS_PER_TOKEN)
            kick(rep, now)
    counters = [rep.scheduler.counters for rep in replicas.values()]
    queried = sum(c.num_prompt_tokens_queried for c in counters)
    hit = sum(c.num_prompt_tokens_hit for c in counters)
    ttfts = [p.ttft_s for p in pending.values() if p.ttft_s is not None]
    served = [rep.served for rep in replicas.values()]
    return ReplayResult(hit_rate=hit / queried if queried else 0.0, ttft_p50_s=_pct(ttfts, 0.5),
                        ttft_p99_s=_pct(ttfts, 0.99), ttft_mean_s=sum(ttfts) / len(ttfts),
                        max_over_mean_load=max(served) / (sum(served) / len(served)), decisions=decisions,
                        ttft_by_request={i: p.ttft_s for i, p in pending.items() if p.ttft_s is not None},
                        replica_by_request={i: p.replica_id for i, p in pending.items()},
                        cached_by_request={i: p.cached_tokens for i, p in pending.items()
                                           if p.cached_tokens is not None},
                        index_capacity_chunks={rid: gateways[0].indexes.get(rid).capacity for rid in replicas})


def to_a_holder_share(reqs: list[workloads.Request],
                      replica_by_request: dict[int, str]) -> tuple[float | None, float | None]:
    """`bench_routing_gateways.py`'s agreement figures: of the requests that repeat a prefix (share at
    least half their prompt with an earlier one), the share sent to a replica an earlier one went to, by
    request and weighted by the characters each shares with its previous one (None without repeats)."""
    from loadtests.bench_routing_gateways import (earlier_with_prefix, home_replica_share, previous_with_prefix,
                                                  repeated_prefix_chars)

    results = [{"replica": replica_by_request.get(i), "kind": r.kind} for i, r in enumerate(reqs)]
    chars = repeated_prefix_chars(reqs, previous_with_prefix(reqs))
    shares = home_replica_share(results, earlier_with_prefix(reqs), chars)
    return shares["share"], shares["chars_share"]


def ttft_floor_s(reqs: list[workloads.Request], spec: SchedulerSpec) -> list[float]:
    """Each request's time to first token on a replica with an infinite cache and nothing else to do: its
    uncached prompt tokens (`workloads.infinite_cache_hits`) at the replica's prefill speed (the first
    token comes with the prefill's last step; a step that also decodes others takes longer). No router
    beats these; their p99 says how low a p99 target can go."""
    return [(tokens - hit) / spec.prefill_tokens_per_s for tokens, hit in workloads.infinite_cache_hits(reqs)]


def bench_spec(reqs: list[workloads.Request], num_replicas: int, load: float = 1.0,
               kv_factor: float = 1.0) -> SchedulerSpec:
    """The replica sizing of `bench_routing.py`'s sim mode."""
    info = workloads.summary(reqs)
    kv_tokens = max(2048, int(kv_factor * info["unique_tokens"] / num_replicas))
    prefill_tps = info["prompt_tokens"] / max(1.0, info["span_s"]) / (num_replicas * load)
    return SchedulerSpec(kv_capacity_tokens=kv_tokens, prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=50.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["hot_prefix", "mooncake"], default="mooncake")
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 16])
    p.add_argument("--policy", choices=["kvgate", "sglang", "oracle"], default="kvgate",
                   help="kvgate: the registry's policy with --set overrides; sglang: SglangLike; oracle: "
                        "perfect knowledge of caches and queues, --set miss_cost_weight applies")
    p.add_argument("--mooncake-requests", type=int, default=1200, help="first N trace rows (bench_routing's default)")
    p.add_argument("--bursts", type=int, default=8, help="hot_prefix bursts (bench_routing's default)")
    p.add_argument("--gateways", type=int, default=1, help="gateways sharing nothing; requests split at random")
    p.add_argument("--no-kv-size", action="store_true",
                   help="replicas that report no KV size: the text index has its default size (prefix_index)")
    p.add_argument("--floor", action="store_true",
                   help="print only the TTFT floor: p50 / p99 with an infinite cache and no queue (ttft_floor_s)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a registry routing field, e.g. --set load_epsilon=0.5 (repeatable)")
    args = p.parse_args(argv)
    bad = [item for item in args.set if "=" not in item]
    if bad:
        p.error(f"--set takes FIELD=VALUE, got {bad[0]!r}")
    overrides = dict(item.split("=", 1) for item in args.set)
    try:
        routing = Routing(**overrides)
    except ValueError as exc:  # pydantic's ValidationError: an unknown field or a bad value
        p.error(f"--set: {exc}")
    knobs = RoutingKnobs.from_routing(routing)
    if args.workload == "mooncake":
        reqs = workloads.mooncake(MODEL, args.mooncake_requests, 8.0)
    else:
        reqs = workloads.hot_prefix(MODEL, args.bursts, 2.0)
    best = workloads.infinite_cache_hit_rate(reqs)
    for n in args.replicas:
        if args.floor:
            floor = sorted(ttft_floor_s(reqs, bench_spec(reqs, n)))  # p99 as the bench takes it
            print(json.dumps({"floor": True, "workload": args.workload, "replicas": n,
                              "p50_ms": round(percentile(floor, 0.5) * 1000),
                              "p99_ms": round(percentile(floor, 0.99) * 1000)}))
            continue
        spec = bench_spec(reqs, n)
        res = replay(reqs, n, spec, knobs, routing.affinity_depth_chars,
                     {"kvgate": choose, "sglang": SglangLike(), "oracle": "oracle"}[args.policy], args.gateways,
                     report_kv_size=not args.no_kv_size)
        print(json.dumps({"policy": args.policy, "workload": args.workload, "replicas": n,
                          "hit_over_best": round(res.hit_rate / best, 3),
                          "p50_ms": round(res.ttft_p50_s * 1000), "p99_ms": round(res.ttft_p99_s * 1000),
                          "max_over_mean": round(res.max_over_mean_load, 2), "decisions": res.decisions,
                          **(dict(zip(("to_a_holder", "to_a_holder_by_chars"),
                                      (x if x is None else round(x, 3)
                                       for x in to_a_holder_share(reqs, res.replica_by_request))))
                             if args.gateways > 1 else {}),
                          **({"index_capacity_chunks": sorted(set(res.index_capacity_chunks.values())),
                              "kv_capacity_chunks": capacity_chunks(spec.kv_capacity_tokens // BLOCK_SIZE_TOKENS,
                                                                    BLOCK_SIZE_TOKENS, CHUNK_CHARS, CHARS_PER_TOKEN)}
                             if args.no_kv_size else {})}))


if __name__ == "__main__":
    main()
