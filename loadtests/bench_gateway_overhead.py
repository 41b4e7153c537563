"""Gateway overhead: what `kvgate router` adds in front of a backend that costs nothing.

Three processes, so none of them measures itself:

  backend   a minimal aiohttp OpenAI stand-in: POST /v1/chat/completions answers at once with a short
            SSE stream (role chunk, 2 content chunks, a finish chunk with usage, [DONE]); GET /health
  gateway   the real `python -m kvgate.router` (uvloop) with one registry model whose only static replica is
            the backend (backend: openai, policy cache_aware)
  load      an aiohttp client in its own process: --connections at a time for --duration-s, each request
            a streamed chat completion read to its end

Two phases, each run against the backend directly and through the gateway:
  latency     --latency-connections (default 1) closed-loop clients: per-request latency p50/p99; the
              gateway's added latency is the difference of the two runs' percentiles
  throughput  --connections (default 256) closed-loop clients: sustained streamed requests/s

The same two phases then run through sglang-router 0.3.2 (`cache_aware`, from its own venv under
loadtests/.work/sglang-router-venv, skipped with a note when that venv is missing) in front of the same
backend with the same load generator, and the table gives kvgate's added latency and requests/s next to
sglang-router's, with the ratio.

Prints a table and writes JSON to loadtests/.work/bench_gateway_overhead.json.

    .venv/bin/python loadtests/bench_gateway_overhead.py
    .venv/bin/python loadtests/bench_gateway_overhead.py --duration-s 20 --connections 512

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


async def _load(url: str, connections: int, duration_s: float, warmup_s: float) -> dict:
    import aiohttp

    latencies_s: list[float] = []
    num_failed = num_sent = 0
    clock = time.perf_counter  # uvloop's loop.time() ticks in whole milliseconds: too coarse here
    start = clock()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal num_failed, num_sent
        while (now := clock()) < stop_at:
            num_sent += 1
            try:
                async with session.post(url, data=BODY, headers=headers) as response:
                    data = await response.read()
                    ok = response.status == 200 and data.endswith(b"data: [DONE]\n\n")
            except aiohttp.ClientError:
                ok = False
            done = clock()
            if now >= measure_from and done <= stop_at:
                if ok:
                    latencies_s.append(done - now)
                else:
                    num_failed += 1

    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(connections)))
    latencies_s.sort()
    return {"connections": connections, "duration_s": duration_s, "num_requests": len(latencies_s),
            "num_sent_with_warmup": num_sent,
            "num_failed": num_failed, "requests_per_s": len(latencies_s) / duration_s,
            "p50_ms": percentile(latencies_s, 0.50, math.nan) * 1e3,
            "p99_ms": percentile(latencies_s, 0.99, math.nan) * 1e3,
            "mean_ms": (statistics.fmean(latencies_s) if latencies_s else 0.0) * 1e3}


def run_load(args: argparse.Namespace) -> None:
    import uvloop
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
            if json.load(response)["num_ready"].get(MODEL):
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


def load_run(url: str, connections: int, duration_s: float, warmup_s: float) -> dict:
    out = subprocess.run([sys.executable, __file__, "load", "--url", url, "--connections", str(connections),
                          "--duration-s", str(duration_s), "--warmup-s", str(warmup_s)],
                         check=True, capture_output=True, text=True)
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


def run_driver(args: argparse.Namespace) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    backend_port, gateway_port = free_port(), free_port()
    backend_url, gateway_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{gateway_port}"
    registry_dir = WORK / "overhead-registry"
    write_registry(registry_dir, backend_url)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [subprocess.Popen([sys.executable, __file__, "backend", "--port", str(backend_port)], env=env)]
    try:
        wait_healthy(backend_url + "/health", processes[0])
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "kvgate.router", "--registry", str(registry_dir), "--port", str(gateway_port),
             "--log-level", "WARNING"], env=env, cwd=ROOT))
        wait_healthy(gateway_url + "/health", processes[1])
        wait_routable(gateway_url)
        path = "/v1/chat/completions"
        rows = {}
        for phase, connections in (("latency", args.latency_connections), ("throughput", args.connections)):
            for target, base in (("direct", backend_url), ("gateway", gateway_url)):
                cpu_before = process_cpu_s(processes[1].pid)
                rows[f"{phase}/{target}"] = load_run(base + path, connections, args.duration_s, args.warmup_s)
                if target == "gateway":  # a figure this shared box's noise moves far less than req/s
                    cpu_s = process_cpu_s(processes[1].pid) - cpu_before
                    rows[f"{phase}/{target}"]["gateway_cpu_us_per_request"] = (
                        cpu_s / max(rows[f"{phase}/{target}"]["num_sent_with_warmup"], 1) * 1e6)
                print(f"  {phase:10s} {target:8s} {rows[f'{phase}/{target}']['requests_per_s']:9.0f} req/s",
                      file=sys.stderr)
        # kvgate's gateway is stopped first, so the peer gets the same CPU the gateway had.
        processes[1].send_signal(signal.SIGINT)
        processes[1].wait(10)
        sglang_skipped = None if args.no_sglang else run_sglang(backend_url, args, rows)
    finally:
        for process in processes:
            process.send_signal(signal.SIGINT)
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    report(rows, args, "--no-sglang" if args.no_sglang else sglang_skipped)


def report(rows: dict, args: argparse.Namespace, sglang_skipped: str | None = None) -> None:
    lat_d, lat_g = rows["latency/direct"], rows["latency/gateway"]
    thr_d, thr_g = rows["throughput/direct"], rows["throughput/gateway"]
    summary = {
        "added_p50_ms": lat_g["p50_ms"] - lat_d["p50_ms"],
        "added_p99_ms": lat_g["p99_ms"] - lat_d["p99_ms"],
        "gateway_streamed_requests_per_s": thr_g["requests_per_s"],
        "direct_streamed_requests_per_s": thr_d["requests_per_s"],
        "gateway_cpu_us_per_request": thr_g.get("gateway_cpu_us_per_request"),
        "targets": {"streamed_requests_per_s_min": 3000, "added_p99_ms_max": 2.0},
        "cpu_count": os.cpu_count(),
        "note": "backend, gateway and load generator share this machine's cores",
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
    print(f"\nGateway overhead ({os.cpu_count()} CPUs shared by load generator, gateway and backend; "
          f"{args.duration_s:g} s per run)\n")
    print(f"{'run':22s} {'conns':>6s} {'req/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'failed':>7s}")
    for name, row in rows.items():
        print(f"{name:22s} {row['connections']:6d} {row['requests_per_s']:9.0f} {row['p50_ms']:8.3f} "
              f"{row['p99_ms']:8.3f} {row['num_failed']:7d}")
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
              f"{thr_g['requests_per_s']:15.0f}")
        print(f"{'sglang-router 0.3.2':22s} {s['added_p50_ms']:13.3f} {s['added_p99_ms']:13.3f} "
              f"{s['streamed_requests_per_s']:15.0f}")
        print(f"{'kvgate / sglang':22s} {ratio(r['added_p50']):>13s} {ratio(r['added_p99']):>13s} "
              f"{ratio(r['streamed_requests_per_s']):>15s}")
    elif sglang_skipped:
        print(f"sglang-router: skipped, {sglang_skipped}")
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
    parser.add_argument("--latency-connections", type=int, default=1)
    parser.add_argument("--no-sglang", action="store_true", help="skip the sglang-router runs")
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
