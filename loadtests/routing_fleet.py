"""Process management for the routing benchmarks: replica fleets (simulated or real engines) and routers.

Used by `bench_routing.py`, `bench_routing_faults.py` and `bench_routing_gateways.py`, so every benchmark puts
the same replicas behind the same routers the same way:

- `start_fleet(n, kv_tokens, prefill_tps, kv_events=False)`: simulated replicas (`sim_replica.py`) in min(n, 4)
  processes (one process per replica up to 4, so one can be SIGKILLed); with `kv_events` each sim tokenizes
  with SIM_TOKENIZER_MODEL's tokenizer and serves kvgate's replica-state protocol on a gRPC port of its own
  (`sim_state.py`), so the gateway lists it as `backend: kvgate` and routes it on its KV block events;
- `start_engine_fleet(n, kv_cache_bytes)`: n real `kvgate engine` processes on builtin:tiny-llama, served as
  MODEL, with the workloads' four LoRA adapters and a WatchState gRPC port each (one torch thread each:
  the box has 2 cores);
- `start_router(name, fleet, ...)`: `kvgate:<policy>` (`kvgate router` with a fresh registry that lists the
  replicas as static replicas), `sglang:cache_aware` or `vllm-router:cache_aware` from their own venvs;
- `replica_counters(session, fleet)`: per replica prompt tokens queried / hit and requests, from the sim's
  /stats or the engine's own Prometheus counters.

    python loadtests/routing_fleet.py _sims --ports 8001,8002 --kv 4096 --prefill 2000   # (internal)
        [--tokenizer-dir DIR --grpc-ports 9001,9002]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
WORK = REPO / "loadtests" / ".work"
MODEL = "sim-llama"
ENGINE_MODEL = "builtin:tiny-llama"
# Sims in KV-events mode tokenize with this model's tokenizer: ~4.1 characters per token on the workloads
# (measured), the sims' own scale of 4, so their token counts and the benchmarks' sizing stay comparable.
SIM_TOKENIZER_MODEL = "builtin:smollm2-135m"
CACHE_DIR = REPO / ".kvgate-cache"

from loadtests import workloads  # noqa: E402
from loadtests.common import stop_process_group  # noqa: E402

SGLANG_PY = WORK / "sglang-router-venv" / "bin" / "python"
VLLM_ROUTER = WORK / "vllm-router-venv" / "bin" / "vllm-router"
ROUTERS = ("kvgate:round_robin", "kvgate:least_load", "kvgate:consistent_hash", "kvgate:cache_aware",
           "sglang:cache_aware", "vllm-router:cache_aware")


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now (all bound at once, so no two are equal)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


# ------------------------------------------------------------------------------------ replica fleets


def serve_sims(argv: list[str]) -> None:
    """`routing_fleet.py _sims --ports a,b,c --kv K --prefill P [--tokenizer-dir D --grpc-ports x,y,z]`:
    several sim replicas in one process (in KV-events mode sharing one tokenizer)."""
    from dataclasses import replace

    from loadtests.sim_replica import SimReplicaConfig, start_sim_replica
    from loadtests.sim_replica_model import SchedulerSpec
    from loadtests.sim_state import SimTokens

    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True)
    p.add_argument("--kv", type=int, required=True)
    p.add_argument("--prefill", type=float, required=True)
    p.add_argument("--decode", type=float, default=50.0)
    p.add_argument("--tokenizer-dir", default=None, help="KV-events mode: tokenize as a kvgate engine with this dir")
    p.add_argument("--grpc-ports", default=None, help="with --tokenizer-dir: a replica-state gRPC port per --ports")
    p.add_argument("--no-kv-size", action="store_true", help="do not export vllm:cache_config_info")
    a = p.parse_args(argv)
    ports = [int(port) for port in a.ports.split(",")]
    grpc_ports: list[int | None] = [None] * len(ports)
    if a.grpc_ports is not None:
        grpc_ports = [int(port) for port in a.grpc_ports.split(",")]
        if a.tokenizer_dir is None or len(grpc_ports) != len(ports):
            p.error("--grpc-ports needs --tokenizer-dir and one port per --ports")
    spec = SchedulerSpec(kv_capacity_tokens=a.kv, prefill_tokens_per_s=a.prefill, decode_tokens_per_s=a.decode,
                         max_batch=16)
    config = SimReplicaConfig(model=MODEL, adapters=workloads.ADAPTERS, scheduler=spec, tokenizer_dir=a.tokenizer_dir,
                              report_kv_size=not a.no_kv_size)
    tokens = SimTokens.load(a.tokenizer_dir) if a.tokenizer_dir else None

    async def run() -> None:
        servers = [await start_sim_replica(replace(config, grpc_port=grpc_port), "127.0.0.1", port, tokens=tokens)
                   for port, grpc_port in zip(ports, grpc_ports)]
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
    """Replica processes. `replica_proc[i]` is the process serving `urls[i]` (shared by several sims at N > 4)."""

    procs: list[subprocess.Popen]
    urls: list[str]
    kind: str = "sim"  # "sim" or "engine"
    # parallel to urls: engines, and sims in KV-events mode; empty otherwise. The registry then lists the
    # replicas as `backend: kvgate` with these targets.
    grpc_targets: list[str] = field(default_factory=list)
    replica_proc: list[int] = field(default_factory=list)

    def kill(self, index: int) -> int:
        """SIGKILL the process serving replica `index` (no drain, no goodbye); returns its pid."""
        proc = self.procs[self.replica_proc[index]]
        proc.kill()
        proc.wait()
        return proc.pid

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                # Engines drain on SIGTERM/SIGINT for up to 30 s; their caches are thrown away anyway.
                p.send_signal(signal.SIGKILL if self.kind == "engine" else signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def sim_tokenizer_dir() -> Path:
    """The directory of SIM_TOKENIZER_MODEL (built into CACHE_DIR on first use)."""
    from kvgate.engine.builtin import resolve_model_source

    return resolve_model_source(SIM_TOKENIZER_MODEL, CACHE_DIR)


def start_fleet(n: int, kv_tokens: int, prefill_tps: float, kv_events: bool = False, kv_size: bool = True) -> Fleet:
    """n simulated replicas, fresh caches, each KV `kv_tokens` tokens and prefill `prefill_tps` tokens/s.
    `kv_events`: in KV-events mode (SIM_TOKENIZER_MODEL's tokenizer, a replica-state gRPC port each).
    Without `kv_size` they do not export their KV size (vllm:cache_config_info)."""
    ports = free_ports(2 * n if kv_events else n)
    ports, grpc_ports = ports[:n], ports[n:]
    groups = min(n, 4)
    tokenizer = ["--tokenizer-dir", str(sim_tokenizer_dir())] if kv_events else []
    procs = []
    for g in range(groups):
        cmd = [sys.executable, __file__, "_sims", "--ports", ",".join(map(str, ports[g::groups])),
               "--kv", str(kv_tokens), "--prefill", str(prefill_tps)]
        if kv_events:
            cmd += [*tokenizer, "--grpc-ports", ",".join(map(str, grpc_ports[g::groups]))]
        if not kv_size:
            cmd.append("--no-kv-size")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError("a sim replica process did not start")
    except BaseException:
        Fleet(procs, []).stop()
        raise
    return Fleet(procs, [f"http://127.0.0.1:{port}" for port in ports], "sim",
                 [f"127.0.0.1:{port}" for port in grpc_ports], [i % groups for i in range(n)])


def engine_adapters() -> list[tuple[str, str]]:
    """The workloads' adapter names, each a random rank-8 PEFT adapter for tiny-llama (written once)."""
    from kvgate.engine.builtin import resolve_model_source
    from loadtests.bench_lora import write_adapters

    model_dir = resolve_model_source(ENGINE_MODEL, CACHE_DIR)
    dirs = write_adapters(model_dir, WORK / "lora-adapters", 8)
    return [(name, directory) for name, (_, directory) in zip(workloads.ADAPTERS, dirs)]


def checkout_env(**extra: str) -> dict[str, str]:
    """The environment for a `kvgate` process started from .venv/bin: this checkout first on PYTHONPATH. The
    venv's console script imports the checkout the venv was installed from (an editable install), so without
    it a benchmark run from a second worktree would time that checkout's router and engine, not its own."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def start_engine_fleet(n: int, kv_cache_bytes: int, max_model_len: int = 1024, log_dir: Path = WORK,
                       timeout_s: float = 90.0) -> Fleet:
    """n `kvgate engine` processes on tiny-llama served as MODEL, healthy when this returns."""
    adapters = engine_adapters()
    ports = free_ports(2 * n)
    http, grpc = ports[:n], ports[n:]
    env = checkout_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", KVGATE_CACHE_DIR=str(CACHE_DIR))
    kvgate = REPO / ".venv" / "bin" / "kvgate"
    procs = []
    for i in range(n):
        cmd = [str(kvgate), "engine", "--model", ENGINE_MODEL, "--served-model-name", MODEL, "--port", str(http[i]),
               "--grpc-port", str(grpc[i]), "--kv-cache-bytes", str(kv_cache_bytes), "--cache-dir", str(CACHE_DIR),
               "--max-model-len", str(max_model_len), "--device", "cpu", "--log-level", "warning",
               "--replica-id", f"engine-{i}"]
        for name, directory in adapters:
            cmd += ["--adapter", f"{name}={directory}"]
        with (log_dir / f"routing-engine-{i}.log").open("w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    fleet = Fleet(procs, [f"http://127.0.0.1:{p}" for p in http], "engine", [f"127.0.0.1:{p}" for p in grpc],
                  list(range(n)))
    deadline = time.monotonic() + timeout_s
    try:
        for i, url in enumerate(fleet.urls):
            while True:
                if procs[i].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine {i} did not become healthy (log {log_dir}/routing-engine-{i}.log)")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.1)
    except BaseException:
        fleet.stop()
        raise
    return fleet


_ENGINE_COUNTER = re.compile(r"^(kvgate_engine_prefix_queried_tokens_total|kvgate_engine_prefix_hit_tokens_total|"
                             r"kvgate_engine_requests_finished_total)(\{[^}]*\})? (\S+)$", re.M)


def parse_engine_counters(text: str) -> dict[str, float]:
    """The engine's /metrics as the sim's /stats names: prompt tokens queried / hit, requests finished."""
    out = {"num_prompt_tokens_queried": 0.0, "num_prompt_tokens_hit": 0.0, "num_requests": 0.0}
    names = {"kvgate_engine_prefix_queried_tokens_total": "num_prompt_tokens_queried",
             "kvgate_engine_prefix_hit_tokens_total": "num_prompt_tokens_hit",
             "kvgate_engine_requests_finished_total": "num_requests"}
    for name, _labels, value in _ENGINE_COUNTER.findall(text):
        out[names[name]] += float(value)
    return out


async def replica_counters(session, fleet: Fleet) -> list[dict | None]:
    """Per replica counters now; None for a replica that does not answer (killed)."""
    async def get(u: str) -> dict | None:
        try:
            if fleet.kind == "sim":
                async with session.get(u + "/stats") as r:
                    return await r.json()
            async with session.get(u + "/metrics") as r:
                return parse_engine_counters(await r.text())
        except Exception:
            return None
    return list(await asyncio.gather(*(get(u) for u in fleet.urls)))


# ------------------------------------------------------------------------------------------- routers


def write_registry(root: Path, fleet: Fleet | list[str], policy: str, chunk_chars: int = 128,
                   routing_extra: str = "") -> None:
    """A registry with MODEL (+ the workloads' adapters) whose static replicas are the fleet's;
    `routing_extra` adds routing fields, e.g. "kv_events: false"."""
    if isinstance(fleet, list):
        fleet = Fleet([], fleet)
    if fleet.grpc_targets:  # engines, or sims in KV-events mode: load and KV blocks from their WatchState streams
        static = ", ".join(f"{{url: '{u}', backend: kvgate, grpc_target: '{g}'}}"
                           for u, g in zip(fleet.urls, fleet.grpc_targets))
    else:
        static = ", ".join(f"{{url: '{u}', backend: vllm}}" for u in fleet.urls)
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
  routing: {{policy: {policy}, prefix_chunk_chars: {chunk_chars}, {routing_extra + ", " if routing_extra else ""}static_replicas: [{static}]}}
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


def start_router(name: str, fleet: Fleet | list[str], tmp: Path, log: Path,
                 chunk_chars: int = 128, routing_extra: str = "") -> tuple[subprocess.Popen, str]:
    """Start router `name` ("kvgate:<policy>", "sglang:cache_aware", ...) in front of the fleet; (process, url).
    `routing_extra`: more registry routing fields for kvgate (see `write_registry`).

    Not yet ready when this returns: send a request until one goes through (`bench_routing.wait_ready`)."""
    urls = fleet if isinstance(fleet, list) else fleet.urls
    kind, policy = name.split(":")
    # The peers also serve Prometheus on a fixed default port: two runs at once (or a run beside the
    # overhead benchmark) would collide there, so each gets a free one.
    port, metrics_port = free_ports(2)
    if kind == "kvgate":
        reg = tmp / "registry"
        reg.mkdir(exist_ok=True)
        write_registry(reg, fleet, policy, chunk_chars, routing_extra)
        cmd = [str(REPO / ".venv" / "bin" / "kvgate"), "router", "--registry", str(reg), "--port", str(port),
               "--log-level", "WARNING"]
    elif kind == "sglang":
        cmd = [str(SGLANG_PY), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--prometheus-port", str(metrics_port), "--worker-urls", *urls]
    else:
        cmd = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--prometheus-port", str(metrics_port), "--worker-urls", *urls]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=checkout_env())
    return proc, f"http://127.0.0.1:{port}"


def stop_router(proc: subprocess.Popen) -> None:
    stop_process_group(proc)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_sims"]:
        serve_sims(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
