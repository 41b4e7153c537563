"""The multi-node topology as real processes on this machine: what `helm install` runs, minus Kubernetes.

    redis-server (no persistence)  <--  2 x `kvgate autoscaler --state redis://...`  (one leads by the lease)
                                   <--  N x `kvgate router --state redis://...`      (the gateways)
    engine replicas: `kvgate engine` processes the leading autoscaler starts through the `local` provider

`Topology` starts, kills and restarts each piece by name, and reads what an operator would look at: the
lease holder and membership records in Redis, each gateway's `kvgate_router_replicas` gauge, and the local
provider's pid files (which replica runs in which process). `loadtests/topology.py` drives it under load;
`tests/e2e/test_topology.py` asserts on it.

The replicas are real engines on builtin tiny-llama (random weights, ~5 s to start on 2 cores, ~30 ms for a
4-token answer): the `local` provider runs `kvgate engine`, and nothing in `kvgate autoscaler` lets a pool
run another command (see the topology script's docstring for the simulated replica's place).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvgate.clock import RealClock
from kvgate.state import RedisStateStore, StateStoreError

MODEL = "tiny-llama"
CLUSTER = "topology"
KEY_PREFIX = "kvgate:"  # the CLI's default, as a chart would leave it
_REPLICAS_GAUGE = re.compile(r'^kvgate_router_replicas\{model="(?P<model>[^"]*)",state="(?P<state>[^"]*)"\} '
                             r'(?P<value>\S+)$', re.M)


class TopologyError(Exception):
    """A piece did not come up or a wait ran out; the message says which, with the end of its log."""


@dataclass(frozen=True)
class TopologySpec:
    """What to run. Times in seconds; the defaults are `kvgate autoscaler`'s own."""

    work_dir: Path
    num_replicas: int = 2
    interval_s: float = 1.0  # autoscaler tick
    lease_ttl_s: float = 10.0  # a dead leader's lease lapses this long after its last renewal
    start_timeout_s: float = 180.0  # a cold engine start on a loaded 2-core host, with margin

    @property
    def member_ttl_s(self) -> float:
        """The membership records' TTL, as `kvgate autoscaler` sets it (not a flag): max(10, 3 x interval)."""
        return max(10.0, 3 * self.interval_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kvgate_command() -> list[str]:
    script = Path(sys.executable).with_name("kvgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvgate.cli"]


def registry_yaml(spec: TopologySpec) -> str:
    """One model on builtin tiny-llama, held at `num_replicas` (min = max: load moves no replica count), on one
    `local` pool slot (CPU replicas take no GPU, so they all fit on it)."""
    n = spec.num_replicas
    return f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {MODEL}}}
spec:
  source: builtin:tiny-llama
  engine: {{max_model_len_tokens: 512, kv_cache_bytes: 32MiB}}
  scaling: {{min_replicas: {n}, max_replicas: {n}, max_queue_wait_s: 30}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: local}}
spec:
  provider: local
  max_nodes: 1
  node_boot_s: 0
  offers: [{{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}}]
  local: {{host: 127.0.0.1, work_dir: "{spec.work_dir / 'local'}"}}
"""


def parse_replica_gauge(metrics_text: str, model: str = MODEL) -> dict[str, int]:
    """state -> replicas of `model` from a gateway's /metrics (`kvgate_router_replicas`)."""
    return {m["state"]: int(float(m["value"])) for m in _REPLICAS_GAUGE.finditer(metrics_text)
            if m["model"] == model}


def log_tail(path: Path, num_chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no log)"


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                     poll_s: float = 0.05, log: Path | None = None) -> float:
    """Poll `condition` until it holds; returns the monotonic time it was first seen true. Raises TopologyError
    naming `what` (and the end of `log`) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await condition():
            return time.monotonic()
        if time.monotonic() > deadline:
            tail = f"\n--- {log}:\n{log_tail(log)}" if log is not None else ""
            raise TopologyError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")
        await asyncio.sleep(poll_s)


class Topology:
    """The processes of one topology, each known by name: "redis", autoscaler holders, gateway names.
    Use as `async with Topology(spec) as topo:`; leaving stops every process it started and every engine
    replica the autoscalers left running (they leave them on purpose, for the next autoscaler)."""

    def __init__(self, spec: TopologySpec) -> None:
        self.spec = spec
        self.registry_dir = spec.work_dir / "registry"
        self.local_dir = spec.work_dir / "local"
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.gateway_ports: dict[str, int] = {}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._num_starts: dict[str, int] = {}
        self._store: RedisStateStore | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Topology:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        (self.registry_dir / "registry.yaml").write_text(registry_yaml(self.spec))
        self._store = RedisStateStore.from_url(self.redis_url, RealClock(), prefix=KEY_PREFIX, timeout_s=0.5)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for name, process in list(self.processes.items()):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                await asyncio.to_thread(process.wait, 10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pgid in self.replica_pids().values():  # the engines the autoscalers left for their successors
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        if self._store is not None:
            await self._store.close()
        if self._http is not None:
            await self._http.close()

    # ---------------------------------------------------------------------------- processes

    def log_path(self, name: str) -> Path:
        """The log of process `name`; a restarted one appends to the same file."""
        return self.spec.work_dir / f"{name}.log"

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        if name in self.processes and self.processes[name].poll() is None:
            raise TopologyError(f"{name} is already running")
        with open(self.log_path(name), "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = process
        self._num_starts[name] = self._num_starts.get(name, 0) + 1
        return process

    def kill(self, name: str) -> float:
        """SIGKILL process `name` (no goodbye: no lease released, no drain) and reap it; returns the monotonic
        time of the kill."""
        process = self.processes[name]
        killed_at = time.monotonic()
        process.kill()
        process.wait()
        return killed_at

    async def start_redis(self) -> float:
        """A fresh, empty redis-server on this topology's port (no persistence, so a restart is empty).
        Returns the monotonic time it first answered."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise TopologyError("redis-server not found; `make test` installs it (apt-get install redis-server)")
        self._spawn("redis", [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(self.spec.work_dir)])
        return await wait_until(self._redis_answers, 10, "redis-server to answer PING", log=self.log_path("redis"))

    async def _redis_answers(self) -> bool:
        if self.processes["redis"].poll() is not None:
            raise TopologyError(f"redis-server exited:\n{log_tail(self.log_path('redis'))}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        except OSError:
            return False
        try:
            writer.write(b"PING\r\n")
            return (await asyncio.wait_for(reader.read(16), 1.0)).startswith(b"+PONG")
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()

    def start_autoscaler(self, holder: str) -> None:
        """`kvgate autoscaler` named `holder` in the lease (its log: `<holder>.log`)."""
        self._spawn(holder, [*kvgate_command(), "autoscaler", "--registry", str(self.registry_dir),
                             "--state", self.redis_url, "--cluster", CLUSTER,
                             "--interval-s", f"{self.spec.interval_s:g}", "--lease-ttl-s", f"{self.spec.lease_ttl_s:g}",
                             "--holder", holder])

    def start_gateway(self, name: str) -> str:
        """`kvgate router` named `name`, on the port it had before if it ran before (a replaced pod behind the
        same Service); returns its URL."""
        port = self.gateway_ports.setdefault(name, free_port())
        self._spawn(name, [*kvgate_command(), "router", "--registry", str(self.registry_dir), "--port", str(port),
                           "--state", self.redis_url, "--gateway-id", name])
        return self.gateway_url(name)

    def gateway_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[name]}"

    def num_starts(self, name: str) -> int:
        return self._num_starts.get(name, 0)

    # ---------------------------------------------------------------------------- what is there

    async def lease_holder(self) -> str | None:
        """The autoscaler holding the lease now; None when nobody does or Redis does not answer."""
        assert self._store is not None
        try:
            return await self._store.lease_holder("autoscaler")
        except StateStoreError:
            return None

    async def member_ids(self) -> set[str]:
        """Replica ids with a live membership record (READY or not); empty when Redis does not answer."""
        assert self._store is not None
        try:
            return {m.replica_id for m in await self._store.list_members(MODEL)}
        except StateStoreError:
            return set()

    async def gateway_replicas(self, name: str) -> dict[str, int]:
        """state -> replicas that gateway `name` tracks (its `kvgate_router_replicas`); {} when it does not answer."""
        assert self._http is not None
        try:
            async with self._http.get(self.gateway_url(name) + "/metrics") as response:
                return parse_replica_gauge(await response.text()) if response.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError):
            return {}

    async def gateway_lists_all(self, name: str) -> bool:
        """Gateway `name` routes to every replica, each listed by a membership record (none kept unlisted)."""
        counts = await self.gateway_replicas(name)
        return counts.get("ready", 0) == self.spec.num_replicas and counts.get("unlisted", 0) == 0

    def replica_pids(self) -> dict[str, int]:
        """replica id -> engine pid, from the local provider's pid files: which replicas run, in which process."""
        pids = {}
        for path in sorted((self.local_dir / "replicas").glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids[path.stem] = int(json.loads(path.read_text())["pid"])
        return pids

    def engine_processes(self) -> list[int]:
        """Pids of every process writing to a replica log of this topology (an engine's stdout is its log under
        the local provider's work_dir): what runs, whatever the pid files say. Linux /proc."""
        logs = str(self.local_dir / "replicas") + os.sep
        pids = []
        for fd in Path("/proc").glob("[0-9]*/fd/1"):
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(logs):
                    pids.append(int(fd.parts[2]))
        return sorted(pids)

    def live_replica_pids(self) -> dict[str, int]:
        """`replica_pids` whose process is alive."""
        return {rid: pid for rid, pid in self.replica_pids().items() if _alive(pid)}

    def replica_starts(self) -> list[str]:
        """Every `replica_start` event the autoscalers logged, in log order per autoscaler."""
        starts = []
        for name in self._num_starts:
            if name != "redis" and name not in self.gateway_ports:
                starts += [line for line in self.log_path(name).read_text(errors="replace").splitlines()
                           if " replica_start: " in line]
        return starts

    # ---------------------------------------------------------------------------- bring-up

    async def bring_up(self, autoscalers: tuple[str, str], gateways: tuple[str, ...]) -> None:
        """Redis, then the first autoscaler (waited on until it holds the lease, so it is the one that leads),
        the second as its standby, the gateways, and the replicas the leader starts: returns once every
        gateway routes to all `num_replicas` of them."""
        await self.start_redis()
        leader, standby = autoscalers
        self.start_autoscaler(leader)
        await wait_until(lambda: self._is_holder(leader), 60, f"autoscaler {leader} to take the lease",
                         log=self.log_path(leader))
        self.start_autoscaler(standby)
        for name in gateways:
            self.start_gateway(name)
        for name in gateways:
            await wait_until(lambda name=name: self.gateway_lists_all(name), self.spec.start_timeout_s,
                             f"gateway {name} to route to {self.spec.num_replicas} ready replicas",
                             poll_s=0.2, log=self.log_path(name))

    async def _is_holder(self, holder: str) -> bool:
        return await self.lease_holder() == holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
