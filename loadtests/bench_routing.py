"""Routing benchmark: kvgate's policies vs sglang-router and vllm-router, same simulated replicas for all.

For each workload (`loadtests/workloads.py`: a scaled Mooncake conversation-trace replay, and a hot-prefix
burst workload with multi-turn conversations and a LoRA mix) and each replica count, every router is put
in front of N fresh simulated replicas (`loadtests/sim_replica.py`: LRU prefix cache + prefill/decode cost
model; restarted before every run so every router starts from cold caches) and the same requests are
replayed at their arrival times by an aiohttp client streaming chat completions. Per router: prompt-token
hit rate from the replicas' counters (/stats: hit / queried tokens), that rate over the infinite-cache
single-replica replay of the same prompts (the best any routing can do), mean / p50 / p99 time to first
token (first non-empty content chunk), throughput, max/mean requests per replica, failed requests.

Replica sizing, per workload and N (stated in the JSON): KV capacity per replica = `--kv-factor` x the
workload's unique prompt tokens / N (at the default 1.0 the cluster holds the working set once, a
replica 1/N of it: eviction matters unless the router partitions prefixes); prefill speed per replica = offered prompt tokens/s
(cold, no cache) / (N x `--load`), so at --load 1.0 the cluster is exactly busy without any cache hit
and a router's hit rate decides whether queues form; decode 50 tokens/s per sequence, batch 16.
Replicas run in min(N, 4) processes (N/4 replicas per process at N >= 16, on one event loop each),
because this box has 2 cores.

    .venv/bin/python loadtests/bench_routing.py --quick            # smoke run, < 2 minutes
    .venv/bin/python loadtests/bench_routing.py                    # both workloads, 4 and 16 replicas
    .venv/bin/python loadtests/bench_routing.py --replicas 4 16 64 --workloads hot_prefix

Peers live in their own venvs under loadtests/.work/ (never in the project's dependencies):
    python3 -m venv loadtests/.work/sglang-router-venv && loadtests/.work/sglang-router-venv/bin/pip install sglang-router==0.3.2
    python3 -m venv loadtests/.work/vllm-router-venv && loadtests/.work/vllm-router-venv/bin/pip install vllm-router==0.1.17
A peer whose venv is missing is skipped (and said so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
WORK = REPO / "loadtests" / ".work"
MODEL = "sim-llama"

from loadtests import workloads  # noqa: E402

SGLANG_PY = WORK / "sglang-router-venv" / "bin" / "python"
VLLM_ROUTER = WORK / "vllm-router-venv" / "bin" / "vllm-router"
ROUTERS = ("kvgate:round_robin", "kvgate:least_load", "kvgate:consistent_hash", "kvgate:cache_aware",
           "sglang:cache_aware", "vllm-router:cache_aware")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


# ------------------------------------------------------------------------------------ replica processes


def serve_sims(argv: list[str]) -> None:
    """`bench_routing.py _sims --ports a,b,c --kv K --prefill P`: several sim replicas in one process."""
    from loadtests.sim_replica import SimReplicaConfig, start_sim_replica
    from loadtests.sim_replica_model import SchedulerSpec

    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True)
    p.add_argument("--kv", type=int, required=True)
    p.add_argument("--prefill", type=float, required=True)
    p.add_argument("--decode", type=float, default=50.0)
    a = p.parse_args(argv)
    spec = SchedulerSpec(kv_capacity_tokens=a.kv, prefill_tokens_per_s=a.prefill, decode_tokens_per_s=a.decode,
                         max_batch=16)
    config = SimReplicaConfig(model=MODEL, adapters=workloads.ADAPTERS, scheduler=spec)

    async def run() -> None:
        servers = [await start_sim_replica(config, "127.0.0.1", int(port)) for port in a.ports.split(",")]
        print(f"ready {len(servers)}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            for s in servers:
                await s.close()

    import uvloop
    uvloop.run(run())


@dataclass
class Fleet:
    procs: list[subprocess.Popen]
    urls: list[str]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_fleet(n: int, kv_tokens: int, prefill_tps: float) -> Fleet:
    ports = free_ports(n)
    groups = min(n, 4)
    procs = []
    for g in range(groups):
        mine = ports[g::groups]
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "_sims", "--ports", ",".join(map(str, mine)), "--kv", str(kv_tokens),
             "--prefill", str(prefill_tps)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError("a sim replica process did not start")
    return Fleet(procs, [f"http://127.0.0.1:{port}" for port in ports])


# ------------------------------------------------------------------------------------------- routers


def write_registry(root: Path, urls: list[str], policy: str) -> None:
    static = ", ".join(f"{{url: '{u}', backend: vllm}}" for u in urls)
    adapters = "".join(f"""---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: {a}}}
spec: {{base_model: {MODEL}, source: /adapters/{a}, rank: 8}}
""" for a in workloads.ADAPTERS)
    (root / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {MODEL}}}
spec:
  source: builtin:tiny-llama
  routing: {{policy: {policy}, prefix_chunk_chars: 128, static_replicas: [{static}]}}
{adapters}---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: here}}
spec:
  provider: local
  offers: [{{instance_type: cpu, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}}]
""")


def router_available(name: str) -> str | None:
    """None when `name` can run, else why not."""
    kind = name.split(":")[0]
    if kind == "sglang" and not SGLANG_PY.exists():
        return f"no {SGLANG_PY.relative_to(REPO)} (pip install sglang-router==0.3.2 there)"
    if kind == "vllm-router" and not VLLM_ROUTER.exists():
        return f"no {VLLM_ROUTER.relative_to(REPO)} (pip install vllm-router==0.1.17 there)"
    return None


def start_router(name: str, urls: list[str], tmp: Path, log: Path) -> tuple[subprocess.Popen, str]:
    kind, policy = name.split(":")
    (port,) = free_ports(1)
    if kind == "kvgate":
        reg = tmp / "registry"
        reg.mkdir(exist_ok=True)
        write_registry(reg, urls, policy)
        cmd = [str(REPO / ".venv" / "bin" / "kvgate"), "router", "--registry", str(reg), "--port", str(port),
               "--log-level", "WARNING"]
    elif kind == "sglang":
        cmd = [str(SGLANG_PY), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--worker-urls", *urls]
    else:
        cmd = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *urls]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_router(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -------------------------------------------------------------------------------------------- client


async def wait_ready(session, url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until one tiny chat request goes through the router (its few tokens are subtracted from the stats)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status == 200:
                    await r.read()
                    return
        except Exception:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError("router not ready")


async def one_request(session, url: str, req: workloads.Request, t0: float, timeout_s: float) -> dict:
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
    sent = time.perf_counter()
    ttft = None
    tokens = 0
    done = False
    error = None
    try:
        async with session.post(url + "/v1/chat/completions", json=req.body(),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                error = f"status {r.status}"
            else:
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            if ttft is None:
                                ttft = time.perf_counter() - sent
                            tokens += 1
                if not done:
                    error = "stream ended without [DONE]"
    except Exception as e:  # timeouts and dropped connections are failures, not crashes
        error = f"{type(e).__name__}: {e}"
    return {"ttft": ttft, "tokens": tokens, "ok": done and error is None, "error": error,
            "end": time.perf_counter(), "kind": req.kind}


async def replica_stats(session, urls: list[str]) -> list[dict]:
    async def get(u: str) -> dict:
        async with session.get(u + "/stats") as r:
            return await r.json()
    return list(await asyncio.gather(*(get(u) for u in urls)))


async def router_decisions(session, url: str) -> dict[str, float]:
    """kvgate's `kvgate_router_decisions_total` by reason (empty for peers, or when unreadable)."""
    out: dict[str, float] = {}
    try:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    except Exception:
        return out
    for line in text.splitlines():
        if line.startswith("kvgate_router_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else labels
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


async def replay(url: str, proc: subprocess.Popen, replicas: list[str], reqs: list[workloads.Request],
                 timeout_s: float) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url, proc)
        before = await replica_stats(session, replicas)
        t0 = time.perf_counter() + 0.2
        results = await asyncio.gather(*(one_request(session, url, r, t0, timeout_s) for r in reqs))
        after = await replica_stats(session, replicas)
        decisions = await router_decisions(session, url)
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    queried = sum(a["num_prompt_tokens_queried"] - b["num_prompt_tokens_queried"] for a, b in zip(after, before))
    hit = sum(a["num_prompt_tokens_hit"] - b["num_prompt_tokens_hit"] for a, b in zip(after, before))
    loads = [a["num_requests"] - b["num_requests"] for a, b in zip(after, before)]
    end = max((r["end"] for r in results), default=t0)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            key = (r["error"] or "?")[:80]
            errors[key] = errors.get(key, 0) + 1

    def pct(q: float) -> float | None:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None

    mean_load = statistics.fmean(loads) if loads else 0.0
    return {"num_requests": len(reqs), "num_ok": len(ok), "num_failed": len(reqs) - len(ok), "errors": errors,
            "hit_rate": hit / queried if queried else 0.0, "prompt_tokens_queried": queried,
            "prompt_tokens_hit": hit,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None, "ttft_p50_s": pct(0.5),
            "ttft_p99_s": pct(0.99), "duration_s": end - t0,
            "throughput_rps": len(ok) / (end - t0), "output_tokens_per_s": sum(r["tokens"] for r in ok) / (end - t0),
            "router_decisions": decisions, "replica_loads": loads, "max_over_mean_load": max(loads) / mean_load if mean_load else None}


# ------------------------------------------------------------------------------------------ the runs


def make_workload(name: str, quick: bool, args: argparse.Namespace) -> list[workloads.Request]:
    if name == "mooncake":
        n = 300 if quick else args.mooncake_requests
        return workloads.mooncake(MODEL, n, args.speedup)
    bursts = 3 if quick else args.bursts
    return workloads.hot_prefix(MODEL, bursts, args.burst_gap_s)


def run_cell(workload: str, reqs: list[workloads.Request], n: int, routers: list[str],
             args: argparse.Namespace) -> dict:
    info = workloads.summary(reqs)
    best = workloads.infinite_cache_hit_rate(reqs)
    kv_tokens = max(2048, int(args.kv_factor * info["unique_tokens"] / n))
    offered_tps = info["prompt_tokens"] / max(1.0, info["span_s"])
    prefill_tps = offered_tps / (n * args.load)
    cell = {"workload": workload, "replicas": n, "workload_summary": info, "infinite_cache_hit_rate": best,
            "replica_kv_capacity_tokens": kv_tokens, "replica_prefill_tokens_per_s": prefill_tps,
            "replica_decode_tokens_per_s": 50.0, "load": args.load, "results": {}, "skipped": {}}
    print(f"\n== {workload}, {n} replicas: {info['num_requests']} requests over {info['span_s']:.1f} s, "
          f"{info['prompt_tokens']} prompt tokens, {info['unique_tokens']} unique; infinite-cache hit rate "
          f"{best:.3f}; replica KV {kv_tokens} tokens, prefill {prefill_tps:.0f} tok/s", flush=True)
    for name in routers:
        why = router_available(name)
        if why:
            cell["skipped"][name] = why
            print(f"  {name}: skipped, {why}", flush=True)
            continue
        fleet = start_fleet(n, kv_tokens, prefill_tps)
        with tempfile.TemporaryDirectory() as tmp:
            log = WORK / f"bench_routing-{name.replace(':', '-')}.log"
            proc, url = start_router(name, fleet.urls, Path(tmp), log)
            try:
                res = asyncio.run(replay(url, proc, fleet.urls, reqs, args.timeout_s))
            except Exception as e:
                res = None
                cell["skipped"][name] = f"run failed: {e} (log {log.relative_to(REPO)})"
                print(f"  {name}: run failed: {e}", flush=True)
            finally:
                stop_router(proc)
                fleet.stop()
        if res is not None:
            res["hit_rate_over_best"] = res["hit_rate"] / best if best else None
            cell["results"][name] = res
            print(f"  {name}: hit {res['hit_rate']:.3f}, p99 TTFT {res['ttft_p99_s']}, failed {res['num_failed']}"
                  f"{', decisions ' + str(res['router_decisions']) if res['router_decisions'] else ''}", flush=True)
    return cell


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(cell: dict) -> None:
    print(f"\n### {cell['workload']}, {cell['replicas']} simulated replicas "
          f"(infinite-cache hit rate {cell['infinite_cache_hit_rate']:.3f})")
    print("| router:policy | hit rate | hit / best | TTFT mean ms | p50 ms | p99 ms | req/s | out tok/s "
          "| max/mean load | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in cell["results"].items():
        ms = lambda v: fmt(None if v is None else v * 1000, ".0f")  # noqa: E731
        print(f"| {name} | {r['hit_rate']:.3f} | {fmt(r['hit_rate_over_best'], '.3f')} | {ms(r['ttft_mean_s'])} "
              f"| {ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {r['throughput_rps']:.1f} "
              f"| {r['output_tokens_per_s']:.0f} | {fmt(r['max_over_mean_load'], '.2f')} | {r['num_failed']} |")
    for name, why in cell["skipped"].items():
        print(f"| {name} | skipped: {why} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_sims"]:
        serve_sims(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 replicas, small workloads, 3 routers")
    p.add_argument("--workloads", nargs="+", default=["hot_prefix", "mooncake"], choices=["hot_prefix", "mooncake"])
    p.add_argument("--replicas", nargs="+", type=int, default=[4, 16])
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument("--mooncake-requests", type=int, default=1200, help="first N trace rows")
    p.add_argument("--speedup", type=float, default=8.0, help="trace time compression factor")
    p.add_argument("--bursts", type=int, default=8)
    p.add_argument("--burst-gap-s", type=float, default=2.0)
    p.add_argument("--kv-factor", type=float, default=1.0)
    p.add_argument("--load", type=float, default=1.0, help="offered cold prompt tokens / cluster prefill capacity")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per request; past it a request counts as failed")
    p.add_argument("--out", type=Path, default=WORK / "bench_routing.json")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas = [4]
        args.routers = ["kvgate:round_robin", "kvgate:cache_aware", "sglang:cache_aware"]
        if args.out == WORK / "bench_routing.json":
            args.out = WORK / "bench_routing-quick.json"
    WORK.mkdir(parents=True, exist_ok=True)
    cells = []
    for workload in args.workloads:
        reqs = make_workload(workload, args.quick, args)
        for n in args.replicas:
            cells.append(run_cell(workload, reqs, n, args.routers, args))
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cells": cells},
                                           indent=2))
    for cell in cells:
        print_table(cell)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
