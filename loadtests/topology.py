"""The multi-node topology under load: kill the leading autoscaler, kill a gateway, restart Redis empty.

Runs what the Helm chart deploys as real processes on this machine (`topology_stack.py`): a redis-server
without persistence, two `kvgate autoscaler` (the first leads through the Redis lease, the second waits as
standby), two `kvgate router`, and the engine replicas the leader starts through the `local` provider (real
`kvgate engine` on builtin tiny-llama). Client loops send short chat completions, streamed and not, one at a
time, through both gateways the whole time, while the script goes through four phases:

1. **steady**: the baseline.
2. **leader killed**: SIGKILL the leading autoscaler. Measured: the takeover, from the kill to the standby
   holding the lease (the first step of its first leader tick), expected between lease_ttl - interval and
   lease_ttl + interval. The killed pod is then replaced (a new autoscaler, which waits as standby).
3. **gateway killed**: SIGKILL the second gateway; its clients fail until it is replaced (a new process on
   the same port, as a pod behind the same Service) and counted apart; the first gateway's must not fail.
4. **redis restarted empty**: SIGKILL redis-server and, `--redis-down-s` later (a pod rescheduled), start an
   empty one on the same port. Measured: from the restart until the membership records are back in Redis, and
   until each gateway lists every replica by its record again.

Throughout: which replicas run, in which process (the local provider's pid files), and every `replica_start`
the autoscalers logged, so a replica started twice would show. Requests are counted by the phase they
ended in; a failure is an HTTP error, a connection error or a stream that ends without `data: [DONE]`.

    .venv/bin/python loadtests/topology.py                  # ~1 min a run, the autoscaler's default timings
    .venv/bin/python loadtests/topology.py --runs 3         # three fresh topologies, then medians and ranges
    .venv/bin/python loadtests/topology.py --interval-s 0.5 --lease-ttl-s 4   # the e2e test's timings

The replicas are real engines, not `sim_replica.py`: `kvgate autoscaler` starts replicas only through its
pools' providers, and the `local` provider always runs `kvgate engine`. Tiny-llama answers a 4-token request
in ~30 ms, enough for the few loops here; heavier load would want a simulated replica the local provider can
start (a pool setting for the engine command), which does not exist yet.

Prints a table and writes loadtests/.work/topology.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from loadtests.common import percentile  # noqa: E402
from loadtests.topology_stack import MODEL, Topology, TopologySpec, wait_until  # noqa: E402

WORK = REPO / "loadtests" / ".work"
LEADER, STANDBY, REPLACEMENT = "autoscaler-a", "autoscaler-b", "autoscaler-c"
GATEWAYS = ("gateway-1", "gateway-2")
KILLED_GATEWAY = "gateway-2"
PHASES = ("steady", "leader killed", "gateway killed", "redis restarted empty")


# ---------------------------------------------------------------------------------------- the clients


@dataclass(frozen=True)
class Outcome:
    """One request: through which gateway, streamed or not, when (monotonic s), and what went wrong (None: a
    complete answer)."""

    gateway: str
    streamed: bool
    started_at: float
    ended_at: float
    error: str | None


class ClientLoad:
    """`clients_per_gateway` loops per gateway, each sending one chat completion at a time (streamed and not, in
    turn) and pausing `pause_s` between them; every outcome is kept."""

    def __init__(self, urls: Mapping[str, str], clients_per_gateway: int, pause_s: float,
                 timeout_s: float = 30.0) -> None:
        self._urls = dict(urls)
        self._clients_per_gateway = clients_per_gateway
        self._pause_s = pause_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.outcomes: list[Outcome] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    def start(self) -> None:
        for gateway in self._urls:
            for client in range(self._clients_per_gateway):
                self._tasks.append(asyncio.create_task(self._loop(gateway, client), name=f"client-{gateway}-{client}"))

    async def stop(self) -> list[Outcome]:
        """Let every loop finish the request it has in flight, then return all outcomes."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes

    async def _loop(self, gateway: str, client: int) -> None:
        # One connection pool per loop, as separate clients would have; a dead gateway's connections go with it.
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            n = 0
            while not self._stopping.is_set():
                streamed = n % 2 == 1
                started_at = time.monotonic()
                error = await self._one(session, self._urls[gateway], streamed, f"client {client} of {gateway}, #{n}")
                self.outcomes.append(Outcome(gateway, streamed, started_at, time.monotonic(), error))
                n += 1
                # after a failure, a little longer: a refused connection fails in ~1 ms and would spin
                await asyncio.sleep(self._pause_s if error is None else max(self._pause_s, 0.2))

    @staticmethod
    async def _one(session: aiohttp.ClientSession, url: str, streamed: bool, text: str) -> str | None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{text}: say something"}],
                "max_tokens": 4, "temperature": 0, "stream": streamed}
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    await response.read()
                    return f"HTTP {response.status}"
                if not streamed:
                    answer = await response.json()
                    return None if answer.get("choices") else "no choices in the answer"
                done = False
                async for raw in response.content:
                    line = raw.decode(errors="replace").strip()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"error"' in line:
                        return "error event in the stream"
                return None if done else "stream ended without [DONE]"
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            return type(exc).__name__


# ---------------------------------------------------------------------------------------- tallies


def tally(outcomes: Sequence[Outcome], phase_starts: Sequence[tuple[str, float]], end: float,
          gateways: Sequence[str]) -> list[dict]:
    """Per phase (each from its start to the next one's, the last to `end`): requests sent and failed per
    gateway, by the time they ended, the reasons of the failures, and the latency of the complete answers."""
    rows = []
    bounds = [*(start for _, start in phase_starts[1:]), end]
    for (name, start), stop in zip(phase_starts, bounds):
        inside = [o for o in outcomes if start <= o.ended_at < stop]
        per_gateway = {}
        for gateway in gateways:
            mine = [o for o in inside if o.gateway == gateway]
            reasons: dict[str, int] = {}
            for o in mine:
                if o.error is not None:
                    reasons[o.error] = reasons.get(o.error, 0) + 1
            per_gateway[gateway] = {"sent": len(mine), "failed": sum(reasons.values()), "reasons": reasons}
        latencies = sorted(o.ended_at - o.started_at for o in inside if o.error is None)
        rows.append({"phase": name, "duration_s": round(stop - start, 2), "gateways": per_gateway,
                     "latency_p50_ms": _ms(percentile(latencies, 0.50)),
                     "latency_p99_ms": _ms(percentile(latencies, 0.99))})
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _count(topo: Topology, name: str, text: str) -> int:
    path = topo.log_path(name)
    return path.read_text(errors="replace").count(text) if path.exists() else 0


# ---------------------------------------------------------------------------------------- the scenario


@dataclass(frozen=True)
class Plan:
    """How long each phase lasts and how hard the clients push. Seconds."""

    clients_per_gateway: int = 2
    pause_s: float = 0.05
    steady_s: float = 5.0
    settle_s: float = 3.0  # load kept on after each event has played out, before the next
    gateway_down_s: float = 3.0  # from a gateway's kill to its replacement's start
    redis_down_s: float = 2.0  # from redis-server's kill to the empty one's start: a pod rescheduled, not instant


async def run_scenario(spec: TopologySpec, plan: Plan) -> dict:
    """Bring the topology up, run the four phases under load, and return everything measured (JSON-ready)."""
    result: dict = {"spec": {**asdict(spec), "work_dir": str(spec.work_dir), "member_ttl_s": spec.member_ttl_s},
                    "plan": asdict(plan)}
    async with Topology(spec) as topo:
        t0 = time.monotonic()
        await topo.bring_up((LEADER, STANDBY), GATEWAYS)
        result["bring_up_s"] = round(time.monotonic() - t0, 1)
        replicas_at_start = topo.live_replica_pids()
        result["engine_processes_at_start"] = topo.engine_processes()
        load = ClientLoad({g: topo.gateway_url(g) for g in GATEWAYS}, plan.clients_per_gateway, plan.pause_s)
        phase_starts: list[tuple[str, float]] = [(PHASES[0], time.monotonic())]
        load.start()
        try:
            await asyncio.sleep(plan.steady_s)

            phase_starts.append((PHASES[1], time.monotonic()))
            result["leader_failover"] = await _kill_the_leader(topo, plan)
            result["replicas_after_failover"] = topo.live_replica_pids()

            phase_starts.append((PHASES[2], time.monotonic()))
            result["gateway_kill"] = await _kill_a_gateway(topo, plan)

            phase_starts.append((PHASES[3], time.monotonic()))
            result["redis_restart"] = await _restart_redis_empty(topo, plan)
        finally:
            end = time.monotonic()
            outcomes = await load.stop()  # also when a phase failed: no client outlives the processes
        result["phases"] = tally(outcomes, phase_starts, end, GATEWAYS)
        result["replicas_at_start"] = replicas_at_start
        result["replicas_at_end"] = topo.live_replica_pids()
        result["engine_processes_at_end"] = topo.engine_processes()
        result["replica_starts"] = topo.replica_starts()
        result["lease_holder_at_end"] = await topo.lease_holder()
    return result


async def _kill_the_leader(topo: Topology, plan: Plan) -> dict:
    spec = topo.spec
    killed_at = topo.kill(LEADER)

    async def standby_leads() -> bool:
        return await topo.lease_holder() == STANDBY
    # Bound: the lease, a tick, and a loaded host's slack; a standby that never takes over fails here.
    led_at = await wait_until(standby_leads, spec.lease_ttl_s + spec.interval_s + 30, f"{STANDBY} to take the lease",
                              log=topo.log_path(STANDBY))
    takeover_s = led_at - killed_at
    await asyncio.sleep(plan.settle_s)
    topo.start_autoscaler(REPLACEMENT)  # the killed pod, replaced by its Deployment: a standby now

    async def waits_as_standby() -> bool:
        return _count(topo, REPLACEMENT, "waiting as standby") > 0
    await wait_until(waits_as_standby, 60, f"{REPLACEMENT} to start as standby", log=topo.log_path(REPLACEMENT))
    return {"killed": LEADER, "new_leader": STANDBY, "takeover_s": round(takeover_s, 3),
            "expected_takeover_s": [round(spec.lease_ttl_s - spec.interval_s, 3),
                                    round(spec.lease_ttl_s + spec.interval_s, 3)],
            "replacement_standby": REPLACEMENT}


async def _kill_a_gateway(topo: Topology, plan: Plan) -> dict:
    killed_at = topo.kill(KILLED_GATEWAY)
    await asyncio.sleep(plan.gateway_down_s)
    restarted_at = time.monotonic()
    topo.start_gateway(KILLED_GATEWAY)
    ready_at = await wait_until(lambda: topo.gateway_lists_all(KILLED_GATEWAY), 120,
                                f"the replaced {KILLED_GATEWAY} to route to every replica", poll_s=0.1,
                                log=topo.log_path(KILLED_GATEWAY))
    await asyncio.sleep(plan.settle_s)
    return {"killed": KILLED_GATEWAY, "down_s": round(restarted_at - killed_at, 2),
            "replacement_ready_s": round(ready_at - restarted_at, 2)}


async def _restart_redis_empty(topo: Topology, plan: Plan) -> dict:
    spec = topo.spec
    members_before = await topo.member_ids()
    noticed_before = {g: _count(topo, g, "left the membership list") for g in GATEWAYS}
    killed_at = topo.kill("redis")
    await asyncio.sleep(plan.redis_down_s)  # every gateway poll and autoscaler tick meanwhile fails
    answered_at = await topo.start_redis()

    async def members_back() -> bool:
        return await topo.member_ids() >= members_before
    back_at = await wait_until(members_back, 60, "the membership records to be back in Redis",
                               log=topo.log_path(STANDBY))
    listed_at = {}
    for gateway in GATEWAYS:
        # From the moment the records are back, each poll (1 s apart) sees them all: a gateway that saw the
        # empty store keeps its replicas as "unlisted" until its next one.
        listed_at[gateway] = await wait_until(lambda g=gateway: topo.gateway_lists_all(g), 30,
                                              f"{gateway} to list every replica again", log=topo.log_path(gateway))
    await asyncio.sleep(plan.settle_s)
    still_listed = {g: await topo.gateway_lists_all(g) for g in GATEWAYS}
    return {
        "down_s": round(answered_at - killed_at, 3),
        "members_back_s": round(back_at - answered_at, 3),
        "gateways_listing_s": {g: round(at - answered_at, 3) for g, at in listed_at.items()},
        "gateways_still_listing_after_settle": still_listed,
        "gateways_that_saw_the_empty_store": {g: _count(topo, g, "left the membership list") - noticed_before[g]
                                              for g in GATEWAYS},
        "members_before": sorted(members_before), "members_after": sorted(await topo.member_ids()),
        "lease_holder_after": await topo.lease_holder(),
        "member_ttl_s": spec.member_ttl_s,
    }


# ---------------------------------------------------------------------------------------- output


def print_run(result: dict) -> None:
    gateways = list(result["phases"][0]["gateways"])
    head = " | ".join(f"{g} sent | {g} failed" for g in gateways)
    print(f"\n| phase | s | {head} | p50 ms | p99 ms |")
    print("|---|---:|" + "---:|" * (2 * len(gateways)) + "---:|---:|")
    for row in result["phases"]:
        cells = " | ".join(f"{row['gateways'][g]['sent']} | {row['gateways'][g]['failed']}" for g in gateways)
        print(f"| {row['phase']} | {row['duration_s']:.1f} | {cells} | {row['latency_p50_ms']} "
              f"| {row['latency_p99_ms']} |")
    failover, gateway, redis = result["leader_failover"], result["gateway_kill"], result["redis_restart"]
    low, high = failover["expected_takeover_s"]
    print(f"\ntakeover (kill -> standby holds the lease): {failover['takeover_s']:.2f} s (lease {low:g}-{high:g} s)")
    print(f"replaced gateway routing to every replica: {gateway['replacement_ready_s']:.2f} s after its start "
          f"(down {gateway['down_s']:.1f} s)")
    print(f"redis restarted empty: down {redis['down_s']:.2f} s (kill to the new one answering); membership "
          f"back {redis['members_back_s']:.2f} s after the restart; gateways listing every replica "
          + ", ".join(f"{g} {s:.2f} s" for g, s in redis["gateways_listing_s"].items())
          + f"; leader after: {redis['lease_holder_after']}")
    same = result["replicas_at_start"] == result["replicas_at_end"]
    print(f"replicas: {len(result['replicas_at_start'])} at start, {len(result['replicas_at_end'])} at end, "
          f"{'the same processes' if same else 'CHANGED'}; engine processes: {len(result['engine_processes_at_start'])} "
          f"at start, {len(result['engine_processes_at_end'])} at end; replica_start events: "
          f"{len(result['replica_starts'])}")
    for row in result["phases"]:
        for g in gateways:
            if row["gateways"][g]["reasons"]:
                print(f"  {row['phase']}, {g}: {row['gateways'][g]['reasons']}")


def summarize(runs: Sequence[dict]) -> dict:
    """Median and range over runs of the figures that vary."""
    def stats(values: list[float]) -> dict:
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}
    figures = {
        "takeover_s": [r["leader_failover"]["takeover_s"] for r in runs],
        "redis_members_back_s": [r["redis_restart"]["members_back_s"] for r in runs],
        "redis_gateways_listing_s": [max(r["redis_restart"]["gateways_listing_s"].values()) for r in runs],
        "gateway_replacement_ready_s": [r["gateway_kill"]["replacement_ready_s"] for r in runs],
    }
    for phase in PHASES:
        for g in GATEWAYS:
            rows = [next(p for p in r["phases"] if p["phase"] == phase)["gateways"][g] for r in runs]
            figures[f"{phase} / {g} sent"] = [row["sent"] for row in rows]
            figures[f"{phase} / {g} failed"] = [row["failed"] for row in rows]
    return {name: stats([float(v) for v in values]) for name, values in figures.items()}


def print_summary(summary: dict, num_runs: int) -> None:
    print(f"\nover {num_runs} runs: median (min-max)")
    for name, s in summary.items():
        print(f"  {name}: {s['median']:g} ({s['min']:g}-{s['max']:g})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1, help="fresh topologies, one after another")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--interval-s", type=float, default=1.0, help="the autoscalers' tick (default: theirs, 1)")
    p.add_argument("--lease-ttl-s", type=float, default=10.0, help="the autoscaler lease (default: theirs, 10)")
    p.add_argument("--clients-per-gateway", type=int, default=Plan.clients_per_gateway)
    p.add_argument("--pause-s", type=float, default=Plan.pause_s, help="each client's pause between requests")
    p.add_argument("--steady-s", type=float, default=Plan.steady_s)
    p.add_argument("--settle-s", type=float, default=Plan.settle_s)
    p.add_argument("--redis-down-s", type=float, default=Plan.redis_down_s,
                   help="from redis-server's kill to the empty one's start")
    p.add_argument("--out", type=Path, default=WORK / "topology.json")
    args = p.parse_args(argv)
    plan = Plan(clients_per_gateway=args.clients_per_gateway, pause_s=args.pause_s, steady_s=args.steady_s,
                settle_s=args.settle_s, redis_down_s=args.redis_down_s)
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for n in range(args.runs):
        work_dir = WORK / "topology" / f"run-{n}"
        if work_dir.exists():
            shutil.rmtree(work_dir)
        work_dir.mkdir(parents=True)
        spec = TopologySpec(work_dir=work_dir, num_replicas=args.replicas, interval_s=args.interval_s,
                            lease_ttl_s=args.lease_ttl_s)
        print(f"run {n + 1}/{args.runs}: bringing the topology up in {work_dir}", flush=True)
        result = asyncio.run(run_scenario(spec, plan))
        print_run(result)
        out["runs"].append(result)
        args.out.write_text(json.dumps(out, indent=2))
    if args.runs > 1:
        out["summary"] = summarize(out["runs"])
        print_summary(out["summary"], args.runs)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
