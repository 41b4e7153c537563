"""Gateway overhead: what `kvgate router` adds in front of a backend that costs nothing.

Three processes, so none of them measures itself:

  backend   a minimal aiohttp OpenAI stand-in: POST /v1/chat/completions answers at once with a short
            SSE stream (role chunk, 2 content chunks, a finish chunk with usage, [DONE]); GET /health
  gateway   the real `python -m kvgate.router` (uvloop) with one registry model whose only static replica is
            the backend (backend: openai, policy cache_aware)
  load      an aiohttp client in its own process: --connections at a time for --duration-s, each request
            a streamed chat completion read to its end

Three phases, each run against the backend directly and through the gateway:
  latency     --latency-connections (default 1) closed-loop clients: per-request latency p50/p99; the
              gateway's added latency is the difference of the two runs' percentiles
  throughput  --connections (default 256) closed-loop clients: sustained streamed requests/s
  rate        open loop at --rate-per-s (default 1,000) requests/s: added p50/p99 as in `latency`, through the
              open gateway and then, each in a gateway of its own, with auth and limits on: one Tenant declared
              (its key sent with every request, HMAC'd by the gateway), rate limits far above the offered load
              (so every request is admitted through both token buckets and the in-flight counter, and settled)
              held in the gateway's own memory store (`gateway+tenant`) or in a redis-server the script starts
              (`gateway+tenant+redis`, `--state redis://`; skipped with a note when there is no redis-server)

The same two phases then run through sglang-router 0.3.2 (`cache_aware`, from its own venv under
loadtests/.work/sglang-router-venv, skipped with a note when that venv is missing) in front of the same
backend with the same load generator, and the table gives kvgate's added latency and requests/s next to
sglang-router's, with the ratio.

Prints a table and writes JSON to loadtests/.work/bench_gateway_overhead.json.

    .venv/bin/python loadtests/bench_gateway_overhead.py
    .venv/bin/python loadtests/bench_gateway_overhead.py --duration-s 20 --connections 512
    .venv/bin/python loadtests/bench_gateway_overhead.py --phases rate   # only the rows at 1,000 req/s

All three processes share this machine's cores: on a 2-core box the load generator and the backend
take CPU from the gateway, so requests/s through the gateway is a floor, not its ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtests.common import free_port, percentile, stop_process_group  # noqa: E402  (after the path is set)
from loadtests.overhead_tenants import (API_KEY_ENV, TenantCredentials, redis_server,  # noqa: E402
                                        write_tenant)

WORK = ROOT / "loadtests" / ".work"
SGLANG_PY = WORK / "sglang-router-venv" / "bin" / "python"
MODEL = "m"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello, gateway"}],
                   "max_tokens": 2, "stream": True}).encode()


# ------------------------------------------------------------------------------------ backend


def _sse_body() -> bytes:
    base = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    events = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                   "prompt_tokens_details": {"cached_tokens": 0}}},
    ]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def run_backend(port: int) -> None:
    from aiohttp import web

    body = _sse_body()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(body)
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text='{"status": "ok"}', content_type="application/json")

    async def models(request: web.Request) -> web.Response:  # peers may probe it at start
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    import uvloop
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ------------------------------------------------------------------------------------ load


def _request_headers() -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key := os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def _one_request(session, url: str, headers: dict[str, str]) -> bool:
    """One streamed chat completion read to its end: did it end with `[DONE]`?"""
    import aiohttp
    try:
        async with session.post(url, data=BODY, headers=headers) as response:
            data = await response.read()
            return response.status == 200 and data.endswith(b"data: [DONE]\n\n")
    except aiohttp.ClientError:
        return False


def _result(latencies_s: list[float], connections: int, duration_s: float, num_sent: int, num_failed: int) -> dict:
    latencies_s.sort()
    return {"connections": connections, "duration_s": duration_s, "num_requests": len(latencies_s),
            "num_sent_with_warmup": num_sent,
            "num_failed": num_failed, "requests_per_s": len(latencies_s) / duration_s,
            "p50_ms": percentile(latencies_s, 0.50, math.nan) * 1e3,
            "p99_ms": percentile(latencies_s, 0.99, math.nan) * 1e3,
            "mean_ms": (statistics.fmean(latencies_s) if latencies_s else 0.0) * 1e3}


async def _load(url: str, connections: int, duration_s: float, warmup_s: float) -> dict:
    """Closed loop: `connections` clients, each sending its next request when the last one ends."""
    import aiohttp

    latencies_s: list[float] = []
    num_failed = num_sent = 0
    clock = time.perf_counter  # uvloop's loop.time() ticks in whole milliseconds: too coarse here
    start = clock()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    headers = _request_headers()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal num_failed, num_sent
        while (now := clock()) < stop_at:
            num_sent += 1
            ok = await _one_request(session, url, headers)
            done = clock()
            if now >= measure_from and done <= stop_at:
                if ok:
                    latencies_s.append(done - now)
                else:
                    num_failed += 1

    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(connections)))
    return _result(latencies_s, connections, duration_s, num_sent, num_failed)


async def _load_at_rate(url: str, rate_per_s: float, connections: int, duration_s: float, warmup_s: float) -> dict:
    """Open loop: request i is sent at start + i / rate_per_s whether or not earlier ones have ended (up to
    `connections` at once, after which aiohttp queues them). Latency runs from the send to the stream's end;
    every request sent in the measured window counts, however late it ends."""
    import aiohttp

    latencies_s: list[float] = []
    send_lags_s: list[float] = []  # how late the generator sent (it shares the cores): the offered rate's honesty
    num_failed = num_sent = 0
    clock = time.perf_counter
    start = clock()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    headers = _request_headers()

    async def one(session: aiohttp.ClientSession, due: float) -> None:
        nonlocal num_failed
        sent = clock()
        ok = await _one_request(session, url, headers)
        if due >= measure_from:
            send_lags_s.append(sent - due)
            if ok:
                latencies_s.append(clock() - sent)
            else:
                num_failed += 1

    in_flight: set[asyncio.Task] = set()
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        while (due := start + num_sent / rate_per_s) < stop_at:
            if (delay := due - clock()) > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(session, due))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            num_sent += 1
        await asyncio.gather(*in_flight)
    send_lags_s.sort()
    return {**_result(latencies_s, connections, duration_s, num_sent, num_failed), "offered_per_s": rate_per_s,
            "send_lag_p99_ms": percentile(send_lags_s, 0.99, math.nan) * 1e3}


def run_load(args: argparse.Namespace) -> None:
    import uvloop
    if args.rate_per_s:
        result = uvloop.run(_load_at_rate(args.url, args.rate_per_s, args.connections, args.duration_s,
                                          args.warmup_s))
    else:
        result = uvloop.run(_load(args.url, args.connections, args.duration_s, args.warmup_s))
    print(json.dumps(result))


# ------------------------------------------------------------------------------------ driver


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not healthy in {timeout_s} s")


def wait_routable(gateway: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(gateway + "/health", timeout=1) as response:
            health = json.load(response)  # with tenants declared, only the total (model names are private)
            if health.get("num_ready", {}).get(MODEL) or health.get("num_ready_total"):
                return
        time.sleep(0.05)
    raise SystemExit("the gateway never saw its replica ready")


def wait_streams(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until one streamed chat completion goes through `url` (a peer router that has admitted its worker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}")
        request = urllib.request.Request(url + "/v1/chat/completions", data=BODY,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200 and response.read().endswith(b"data: [DONE]\n\n"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not stream a request in {timeout_s} s")


def run_sglang(backend_url: str, args: argparse.Namespace, rows: dict) -> str | None:
    """Both phases through sglang-router in front of `backend_url`, into `rows`; None, or why it was skipped."""
    if not SGLANG_PY.exists():
        return f"no {SGLANG_PY.relative_to(ROOT)} (pip install sglang-router==0.3.2 there)"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (WORK / "bench_gateway_overhead-sglang.log").open("w")
    process = subprocess.Popen([str(SGLANG_PY), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                "--port", str(port), "--policy", "cache_aware", "--log-level", "warn",
                                "--prometheus-port", str(free_port()),  # its default port may be taken
                                "--worker-urls", backend_url], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        wait_streams(url, process)
        for phase, connections in (("latency", args.latency_connections), ("throughput", args.connections)):
            rows[f"{phase}/sglang-router"] = load_run(url + "/v1/chat/completions", connections, args.duration_s,
                                                      args.warmup_s)
            print(f"  {phase:10s} sglang   {rows[f'{phase}/sglang-router']['requests_per_s']:9.0f} req/s",
                  file=sys.stderr)
    except RuntimeError as e:
        return str(e)
    finally:
        stop_process_group(process)
        log.close()
    return None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_run(url: str, connections: int, duration_s: float, warmup_s: float, rate_per_s: float = 0.0,
             env: dict[str, str] | None = None) -> dict:
    """One load generator run in its own process; closed loop, or open loop at `rate_per_s` when it is set."""
    out = subprocess.run([sys.executable, __file__, "load", "--url", url, "--connections", str(connections),
                          "--duration-s", str(duration_s), "--warmup-s", str(warmup_s),
                          "--rate-per-s", str(rate_per_s)],
                         check=True, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_registry(directory: Path, backend_url: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {MODEL}}}
spec:
  source: builtin:tiny-llama
  routing: {{policy: cache_aware, static_replicas: [{{url: '{backend_url}', backend: openai}}]}}
""")


CLOSED_PHASES = ("latency", "throughput")
PATH = "/v1/chat/completions"


def start_gateway(registry_dir: Path, env: dict[str, str], extra_args: tuple[str, ...] = ()) -> tuple[
        subprocess.Popen, str]:
    """`python -m kvgate.router` on a free port, once it has its replica ready: (process, base URL)."""
    url = f"http://127.0.0.1:{(port := free_port())}"
    process = subprocess.Popen([sys.executable, "-m", "kvgate.router", "--registry", str(registry_dir), "--port",
                                str(port), "--log-level", "WARNING", *extra_args], env=env, cwd=ROOT)
    try:
        wait_healthy(url + "/health", process)
        wait_routable(url)
    except BaseException:
        stop_gateway(process)
        raise
    return process, url


def stop_gateway(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def gateway_run(process: subprocess.Popen, url: str, args: argparse.Namespace, phase: str,
                env: dict[str, str] | None = None) -> dict:
    """One phase's load through the gateway `process`, with the CPU it used per request (a figure this shared
    box's noise moves far less than req/s)."""
    cpu_before = process_cpu_s(process.pid)
    row = phase_run(url, args, phase, env)
    row["gateway_cpu_us_per_request"] = (process_cpu_s(process.pid) - cpu_before) / max(
        row["num_sent_with_warmup"], 1) * 1e6
    return row


def phase_run(url: str, args: argparse.Namespace, phase: str, env: dict[str, str] | None = None) -> dict:
    if phase == "rate":
        return load_run(url + PATH, args.rate_connections, args.duration_s, args.warmup_s, args.rate_per_s, env)
    connections = args.latency_connections if phase == "latency" else args.connections
    return load_run(url + PATH, connections, args.duration_s, args.warmup_s)


def run_tenant_rows(backend_url: str, env: dict[str, str], args: argparse.Namespace, rows: dict) -> str | None:
    """The rate phase through a gateway with one tenant (its key sent with every request, limits never reached):
    limits in the gateway's own memory store, then in a redis-server (`--state`). None, or why the redis row
    was skipped."""
    credentials = TenantCredentials.new()
    registry_dir = WORK / "overhead-registry-tenant"
    write_registry(registry_dir, backend_url)
    write_tenant(registry_dir, credentials)

    def measure(name: str, extra_args: tuple[str, ...] = ()) -> None:
        process, url = start_gateway(registry_dir, {**env, **credentials.gateway_env()}, extra_args)
        try:
            rows[f"rate/{name}"] = gateway_run(process, url, args, "rate", credentials.load_env())
        finally:
            stop_gateway(process)
        print(f"  {'rate':10s} {name:22s} {rows[f'rate/{name}']['requests_per_s']:9.0f} req/s", file=sys.stderr)

    measure("gateway+tenant")
    if args.no_redis:
        return "--no-redis"
    try:
        with redis_server(free_port(), WORK) as redis_url:
            measure("gateway+tenant+redis", ("--state", redis_url))
    except RuntimeError as e:
        return str(e)
    return None


def run_driver(args: argparse.Namespace) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    phases = [p for p in ("latency", "throughput", "rate") if p in args.phases.split(",")]
    backend_port = free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    registry_dir = WORK / "overhead-registry"
    write_registry(registry_dir, backend_url)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    backend = subprocess.Popen([sys.executable, __file__, "backend", "--port", str(backend_port)], env=env)
    rows, skipped = {}, {}
    try:
        wait_healthy(backend_url + "/health", backend)
        gateway, gateway_url = start_gateway(registry_dir, env)
        try:
            for phase in phases:
                rows[f"{phase}/direct"] = phase_run(backend_url, args, phase)
                rows[f"{phase}/gateway"] = gateway_run(gateway, gateway_url, args, phase)
                for target in ("direct", "gateway"):
                    print(f"  {phase:10s} {target:22s} {rows[f'{phase}/{target}']['requests_per_s']:9.0f} req/s",
                          file=sys.stderr)
        finally:  # stopped before the next gateway starts, so each gets the CPU this one had
            stop_gateway(gateway)
        if "rate" in phases:
            skipped["redis"] = "--no-tenants" if args.no_tenants else run_tenant_rows(backend_url, env, args, rows)
        if args.no_sglang or not set(CLOSED_PHASES) <= set(phases):
            skipped["sglang"] = "--no-sglang or --phases without latency and throughput"
        else:
            skipped["sglang"] = run_sglang(backend_url, args, rows)
    finally:
        stop_gateway(backend)
    report(rows, args, skipped)


def closed_loop_summary(rows: dict, sglang_skipped: str | None) -> dict:
    """Added latency (1 connection) and streamed requests/s (--connections), kvgate beside sglang-router."""
    lat_d, lat_g = rows["latency/direct"], rows["latency/gateway"]
    thr_d, thr_g = rows["throughput/direct"], rows["throughput/gateway"]
    summary = {
        "added_p50_ms": lat_g["p50_ms"] - lat_d["p50_ms"],
        "added_p99_ms": lat_g["p99_ms"] - lat_d["p99_ms"],
        "gateway_streamed_requests_per_s": thr_g["requests_per_s"],
        "direct_streamed_requests_per_s": thr_d["requests_per_s"],
        "gateway_cpu_us_per_request": thr_g.get("gateway_cpu_us_per_request"),
        "targets": {"streamed_requests_per_s_min": 3000, "added_p99_ms_max": 2.0},
    }
    if "latency/sglang-router" in rows:
        lat_s, thr_s = rows["latency/sglang-router"], rows["throughput/sglang-router"]
        summary["sglang_router"] = {
            "added_p50_ms": lat_s["p50_ms"] - lat_d["p50_ms"], "added_p99_ms": lat_s["p99_ms"] - lat_d["p99_ms"],
            "streamed_requests_per_s": thr_s["requests_per_s"]}
        s = summary["sglang_router"]
        summary["kvgate_over_sglang"] = {
            "added_p50": summary["added_p50_ms"] / s["added_p50_ms"] if s["added_p50_ms"] > 0 else None,
            "added_p99": summary["added_p99_ms"] / s["added_p99_ms"] if s["added_p99_ms"] > 0 else None,
            "streamed_requests_per_s": thr_g["requests_per_s"] / s["streamed_requests_per_s"]
            if s["streamed_requests_per_s"] else None}
    elif sglang_skipped:
        summary["sglang_router_skipped"] = sglang_skipped
    return summary


def rate_summary(rows: dict, rate_per_s: float) -> dict:
    """At a fixed offered rate: each gateway row's added p50/p99 (its percentile minus direct's), target 1 ms."""
    direct = rows["rate/direct"]
    gateways = {name.removeprefix("rate/"): row for name, row in rows.items()
                if name.startswith("rate/") and name != "rate/direct"}
    return {"offered_per_s": rate_per_s, "targets": {"added_p99_ms_max": 1.0},
            "direct": {"p50_ms": direct["p50_ms"], "p99_ms": direct["p99_ms"]},
            **{name: {"added_p50_ms": row["p50_ms"] - direct["p50_ms"],
                      "added_p99_ms": row["p99_ms"] - direct["p99_ms"], "requests_per_s": row["requests_per_s"], "num_failed": row["num_failed"],
                      "gateway_cpu_us_per_request": row["gateway_cpu_us_per_request"],
                      "send_lag_p99_ms": row["send_lag_p99_ms"]} for name, row in gateways.items()}}


def print_closed_loop(summary: dict, rows: dict) -> None:
    print(f"\nadded latency through the gateway: p50 {summary['added_p50_ms']:.3f} ms, "
          f"p99 {summary['added_p99_ms']:.3f} ms (target <= 2 ms)")
    print(f"streamed requests/s through the gateway: {summary['gateway_streamed_requests_per_s']:.0f} "
          f"(target >= 3,000; direct to the backend: {summary['direct_streamed_requests_per_s']:.0f}); the gateway "
          f"used {summary['gateway_cpu_us_per_request']:.0f} us of CPU per request, i.e. "
          f"{1e6 / summary['gateway_cpu_us_per_request']:.0f} requests/s per core")
    if "sglang_router" in summary:
        s, r = summary["sglang_router"], summary["kvgate_over_sglang"]
        ratio = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        print(f"\n{'':22s} {'added p50 ms':>13s} {'added p99 ms':>13s} {'streamed req/s':>15s}")
        print(f"{'kvgate router':22s} {summary['added_p50_ms']:13.3f} {summary['added_p99_ms']:13.3f} "
              f"{rows['throughput/gateway']['requests_per_s']:15.0f}")
        print(f"{'sglang-router 0.3.2':22s} {s['added_p50_ms']:13.3f} {s['added_p99_ms']:13.3f} "
              f"{s['streamed_requests_per_s']:15.0f}")
        print(f"{'kvgate / sglang':22s} {ratio(r['added_p50']):>13s} {ratio(r['added_p99']):>13s} "
              f"{ratio(r['streamed_requests_per_s']):>15s}")
    elif "sglang_router_skipped" in summary:
        print(f"sglang-router: skipped, {summary['sglang_router_skipped']}")


def print_rate(summary: dict) -> None:
    print(f"\nat {summary['offered_per_s']:,.0f} requests/s offered (open loop; direct p50 "
          f"{summary['direct']['p50_ms']:.3f} ms, p99 {summary['direct']['p99_ms']:.3f} ms):")
    print(f"{'':22s} {'added p50 ms':>13s} {'added p99 ms':>13s} {'CPU us/req':>11s} {'failed':>7s}")
    for name, row in summary.items():
        if name.startswith("gateway"):
            print(f"{name:22s} {row['added_p50_ms']:13.3f} {row['added_p99_ms']:13.3f} "
                  f"{row['gateway_cpu_us_per_request']:11.0f} {row['num_failed']:7d}")
    print("target: added p99 <= 1 ms with auth and limits on")


def report(rows: dict, args: argparse.Namespace, skipped: dict[str, str | None]) -> None:
    summary: dict = {"cpu_count": os.cpu_count(), "note": "backend, gateway and load generator share this "
                                                          "machine's cores"}
    print(f"\nGateway overhead ({os.cpu_count()} CPUs shared by load generator, gateway and backend; "
          f"{args.duration_s:g} s per run)\n")
    print(f"{'run':27s} {'conns':>6s} {'req/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'failed':>7s}")
    for name, row in rows.items():
        print(f"{name:27s} {row['connections']:6d} {row['requests_per_s']:9.0f} {row['p50_ms']:8.3f} "
              f"{row['p99_ms']:8.3f} {row['num_failed']:7d}")
    if "latency/gateway" in rows and "throughput/gateway" in rows:
        summary.update(closed_loop_summary(rows, skipped.get("sglang")))
        print_closed_loop(summary, rows)
    if "rate/gateway" in rows:
        summary["at_rate"] = rate_summary(rows, args.rate_per_s)
        if skipped.get("redis"):
            summary["at_rate"]["redis_skipped"] = skipped["redis"]
        print_rate(summary["at_rate"])
        if skipped.get("redis"):
            print(f"gateway+tenant+redis: skipped, {skipped['redis']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role")
    backend = sub.add_parser("backend")
    backend.add_argument("--port", type=int, required=True)
    load = sub.add_parser("load")
    load.add_argument("--url", required=True)
    for p in (parser, load):
        p.add_argument("--connections", type=int, default=256)
        p.add_argument("--duration-s", type=float, default=10.0)
        p.add_argument("--warmup-s", type=float, default=2.0)
    load.add_argument("--rate-per-s", type=float, default=0.0, help="open loop at this rate (0: closed loop)")
    parser.add_argument("--latency-connections", type=int, default=1)
    parser.add_argument("--rate-per-s", type=float, default=1000.0, help="the rate phase's offered requests/s")
    parser.add_argument("--rate-connections", type=int, default=64,
                        help="the rate phase's connection pool (requests over it wait for one)")
    parser.add_argument("--phases", default="latency,throughput,rate",
                        help="comma-separated, of latency, throughput, rate (default: all)")
    parser.add_argument("--no-sglang", action="store_true", help="skip the sglang-router runs")
    parser.add_argument("--no-tenants", action="store_true", help="skip the rate phase's rows with a tenant")
    parser.add_argument("--no-redis", action="store_true", help="skip the rate phase's row with limits in Redis")
    parser.add_argument("--out", default=str(WORK / "bench_gateway_overhead.json"))
    args = parser.parse_args()
    if args.role == "backend":
        run_backend(args.port)
    elif args.role == "load":
        run_load(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
