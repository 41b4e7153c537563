"""A real gateway for the dashboard's tests: `kvgate router`'s app on a real socket, its replicas
published as membership records in a `MemoryStateStore`, the way the autoscaler publishes replicas:
simulated OpenAI servers (`loadtests.sim_replica`: LRU prefix cache, cached_tokens, vLLM /metrics, no
KV block count) and, when a test passes them, real `kvgate engine` processes (gRPC state stream).

No autoscaler runs here (it is not part of the gateway): tests that need its status record write one
in the documented schema with `write_autoscaler_status`, standing in for the autoscaler's loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.clock import RealClock
from kvgate.state import MemberRecord, MemoryStateStore, ReplicaState
from loadtests.sim_replica import SimReplicaConfig, SimReplicaServer, start_sim_replica
from loadtests.sim_replica_model import SchedulerSpec
from kvgate.registry.watch import RegistryWatcher
from kvgate.router.app import GatewaySettings, build_app, gateway_runner
from kvgate.router.replicas import ReplicaTracker, TrackerSettings

MODEL = "tiny-llama"  # the name a `kvgate engine` on builtin:tiny-llama serves, so sims and engines mix
ADAPTER = "sql"
# Fast enough that a test's traffic takes well under a second, slow enough that load is visible.
SIM = SchedulerSpec(prefill_tokens_per_s=200_000.0, decode_tokens_per_s=400.0, kv_capacity_tokens=4096)
SYSTEM_PROMPT = "You are the kvgate operator's assistant. Answer briefly and cite the runbook. " * 12

REGISTRY = """apiVersion: kvgate/v1
kind: Model
metadata: {name: tiny-llama}
spec:
  source: builtin:tiny-llama
  routing: {prefix_chunk_chars: 64}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {name: sql}
spec: {base_model: tiny-llama, source: /adapters/sql, rank: 8}
---
apiVersion: kvgate/v1
kind: Model
metadata: {name: idle}
spec:
  source: builtin:tiny-llama
  scaling: {min_replicas: 0, max_queue_wait_s: 5}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {name: local}
spec:
  provider: local
  offers: [{instance_type: cpu, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}]
"""


@dataclass
class Stack:
    url: str
    store: MemoryStateStore
    sims: list[SimReplicaServer]
    admin_token: str | None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    async def get_json(self, path: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + path, headers=self.headers()) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def chat(self, session: aiohttp.ClientSession, content: str, model: str = MODEL,
                   stream: bool = False, request_id: str | None = None) -> int:
        """One chat completion; its status. A stream asks for the usage chunk, so its tokens count too."""
        body: dict[str, Any] = {
            "model": model, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"X-Request-Id": request_id} if request_id is not None else {}
        async with session.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status


async def write_autoscaler_status(store: MemoryStateStore, wall: float, desired: int, ready: int) -> None:
    """The status record as the autoscaler writes it (collection "autoscaler", id "status")."""
    await store.put_record("autoscaler", "status", {
        "updated_at": wall, "holder": "autoscaler-test",
        "models": {
            MODEL: {"desired": desired, "ready": ready, "starting": max(desired - ready, 0), "panic": desired > ready,
                     "forecast_rps": 3.5, "arrivals_per_s": 2.25, "queued": 0, "reason": "queue 6 / target 2"},
            "idle": {"desired": 0, "ready": 0, "starting": 0, "panic": False, "forecast_rps": None,
                     "arrivals_per_s": 0.0, "queued": 0, "reason": "scaled to zero after 300 s idle"}},
        "events": [
            {"t": wall - 40, "model": None, "kind": "node_create", "message": "node-a: local/cpu on_demand $0.00/h"},
            {"t": wall - 35, "model": MODEL, "kind": "replica_start", "message": "sim-0 on node-a"},
            {"t": wall - 5, "model": MODEL, "kind": "scale_up", "message": f"{MODEL} {ready} -> {desired}: panic"}],
        "nodes": [
            {"id": "node-a", "pool": "local", "instance_type": "cpu", "capacity_type": "on_demand",
             "price_usd_per_hour": 0.0, "state": "ready", "launched_at": wall - 40, "replicas": ["sim-0", "sim-1"]},
            {"id": "node-b", "pool": "aws-us-east-1", "instance_type": "g5.xlarge", "capacity_type": "spot",
             "price_usd_per_hour": 0.4024, "state": "launching", "launched_at": wall - 5, "replicas": []}],
        "cost_usd_per_hour": 0.4024, "cost_usd_total": 0.0056})


@contextlib.asynccontextmanager
async def dashboard_stack(tmp_path: Path, *, num_replicas: int = 2, admin_token: str | None = None,
                          sample_interval_s: float = 0.5, history_s: float = 3600.0,
                          engines: Sequence[tuple[str, str]] = ()) -> AsyncIterator[Stack]:
    """`num_replicas` simulated replicas ("sim-<i>" on node-a) plus `engines` ((url, grpc_target) of
    running `kvgate engine` processes, "engine-<i>" on node-b), all members of `MODEL`."""
    clock = RealClock()
    store = MemoryStateStore(clock)
    sims = [await start_sim_replica(SimReplicaConfig(model=MODEL, adapters=(ADAPTER,), scheduler=SIM))
            for _ in range(num_replicas)]
    runner: web.AppRunner | None = None
    try:
        for i, sim in enumerate(sims):
            await store.put_member(MemberRecord(replica_id=f"sim-{i}", model=MODEL, url=sim.url,
                                                state=ReplicaState.READY, node_id="node-a", pool="local"), ttl_s=600)
        for i, (url, grpc_target) in enumerate(engines):
            await store.put_member(MemberRecord(replica_id=f"engine-{i}", model=MODEL, url=url, grpc_target=grpc_target,
                                                state=ReplicaState.READY, node_id="node-b", pool="local"), ttl_s=600)
        (tmp_path / "registry.yaml").write_text(REGISTRY)
        watcher = await RegistryWatcher.open(tmp_path, clock)
        tracker = ReplicaTracker(clock=clock, store=store, settings=TrackerSettings(
            poll_interval_s=0.25, health_interval_s=5.0, prefix_chunk_chars=64))
        settings = GatewaySettings(admin_token=admin_token, dashboard_sample_interval_s=sample_interval_s,
                                   dashboard_history_s=history_s)
        runner = gateway_runner(build_app(settings, tracker, watcher, clock, store), shutdown_timeout_s=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield Stack(f"http://{host}:{port}", store, sims, admin_token)
    finally:
        if runner is not None:
            await runner.cleanup()
        for sim in sims:
            await sim.close()
        await store.close()
