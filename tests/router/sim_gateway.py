"""The gateway over simulated replicas for the router's end-to-end tests: the official openai SDK ->
kvgate router -> `loadtests.sim_replica` servers on real sockets.

The sims have an LRU prefix cache that reports cached_tokens, and failure injection (`Gateway.fail`);
they are a registry model's static replicas, and the gateway runs the real `ReplicaTracker`. Health
checks run once at start and then every 60 s, so a failure mode switched on afterwards is seen by
requests (and the proxy's retries), not hidden by a health check.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
from aiohttp import web

from loadtests.sim_replica import SimReplicaConfig, SimReplicaServer, start_sim_replica
from loadtests.sim_replica_model import SchedulerSpec
from kvgate.clock import Clock
from kvgate.state.base import StateStore
from kvgate.router.app import GatewaySettings
from kvgate.router.membership import static_replica_id
from kvgate.router.replicas import ReplicaTracker
from tests.eventually import eventually
from tests.gateway_harness import running_gateway

FAST_SIM = SchedulerSpec(prefill_tokens_per_s=1e6, decode_tokens_per_s=2000.0)
LONG_PROMPT = "You are a careful assistant for the kvgate project. " * 40  # ~2,000 chars: 31 chunks of 64
OTHER_LONG_PROMPT = "Answer in French, briefly, and cite the design document. " * 36

POOL = """apiVersion: kvgate/v1
kind: Pool
metadata: {name: here}
spec:
  provider: local
  offers: [{instance_type: cpu, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}]
"""


def write_registry(root: Path, urls: list[str], routing: str = "", backend: str = "openai", spec: str = "") -> None:
    """`spec`: more of model m's spec, one YAML line (`limits: {max_n: 2}`)."""
    static = ", ".join(f"{{url: '{u}', backend: {backend}}}" for u in urls)
    (root / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: m}}
spec:
  source: builtin:tiny-llama
  routing: {{prefix_chunk_chars: 64, max_retries: 2, static_replicas: [{static}] {routing}}}
  {spec}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: sql}}
spec: {{base_model: m, source: /adapters/sql, rank: 8}}
---
apiVersion: kvgate/v1
kind: Model
metadata: {{name: cold}}
spec:
  source: builtin:tiny-llama
  routing: {{max_queued_requests: 1}}
  scaling: {{min_replicas: 0, max_queue_wait_s: 0.3}}
---
{POOL}""")


@dataclass
class Gateway:
    url: str
    tracker: ReplicaTracker
    sims: list[SimReplicaServer]
    client: openai.AsyncOpenAI

    def id_of(self, sim: SimReplicaServer) -> str:
        """The public id the gateway gives `sim` (the x-kvgate-replica header, the metrics' replica label)."""
        return static_id([s.url for s in self.sims], sim.url)

    async def stats(self, sim: SimReplicaServer) -> dict:
        async with aiohttp.ClientSession() as s, s.get(sim.url + "/stats") as r:
            return await r.json()

    async def fail(self, sim: SimReplicaServer, **spec: object) -> None:
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/admin/fail", json=spec) as r:
            assert r.status == 200, await r.text()

    async def post(self, path: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
        async with aiohttp.ClientSession() as s, s.post(self.url + path, data=data, headers=headers) as r:
            return r.status, dict(r.headers), await r.text()


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, num_replicas: int = 3, routing: str = "",
                  settings: GatewaySettings | None = None, sim_spec: SchedulerSpec = FAST_SIM,
                  other_urls: tuple[str, ...] = (), store: StateStore | None = None,
                  backend: str = "openai", clock: Clock | None = None, spec: str = "",
                  poll_interval_s: float = 60.0) -> AsyncIterator[Gateway]:
    """The gateway over `num_replicas` fresh sims (plus `other_urls`), once every sim has answered its
    first health check, so that a failure mode a test switches on is met by requests, not by that check.
    `clock`: see `running_gateway`; `spec`: see `write_registry`; `poll_interval_s`: how often the sims' /metrics
    are scraped (vllm and sglang backends)."""
    sims = [await start_sim_replica(SimReplicaConfig(model="m", adapters=("sql",), scheduler=sim_spec))
            for _ in range(num_replicas)]
    write_registry(tmp_path, [s.url for s in sims] + list(other_urls), routing, backend, spec)
    checked: set[str] = set()  # replicas that answered one of the gateway's health checks
    try:
        async with aiohttp.ClientSession(trace_configs=[health_answers_into(checked)]) as http, \
                running_gateway(tmp_path, settings, store, clock=clock, http=http, prefix_chunk_chars=64,
                                poll_interval_s=poll_interval_s) as (url, tracker):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10.0)
            await eventually(lambda: {s.url for s in sims} <= checked, "every sim answered its first health check")
            try:
                yield Gateway(url, tracker, sims, client)
            finally:
                await client.close()
    finally:
        for sim in sims:
            await sim.close()


def static_id(urls: list[str], url: str, model: str = "m") -> str:
    """The public id of the static replica at `url`, where `urls` are its model's in the registry's order."""
    return static_replica_id(model, urls.index(url))


def health_answers_into(checked: set[str]) -> aiohttp.TraceConfig:
    """A client trace that adds to `checked` the base URL of each replica that answered a GET /health."""
    async def on_request_end(session: aiohttp.ClientSession, context: object,
                             params: aiohttp.TraceRequestEndParams) -> None:
        if params.url.path == "/health":
            checked.add(str(params.url.origin()))

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_request_end)
    return trace


async def admin_replica(gw: Gateway, replica_id: str) -> dict:
    """The replica's entry in the gateway's /admin/stats."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/stats") as r:
        stats = await r.json()
    return next(r for r in stats["models"]["m"]["replicas"] if r["replica_id"] == replica_id)


def chat(content: str, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


@contextlib.asynccontextmanager
async def hand_written_replica(**posts: Callable[[web.Request], Awaitable[web.StreamResponse]]
                               ) -> AsyncIterator[str]:
    """A replica of handlers written in the test (`chat_completions=...`, `completions=...`), with a /health
    that passes; yields its URL."""
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    for name, handler in posts.items():
        app.router.add_post("/v1/" + name.replace("chat_", "chat/"), handler)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def answer_with_usage(usage: str) -> bytes:
    return ('{"id": "x", "object": "chat.completion", "choices": [], "usage": ' + usage + "}").encode()


async def drain_stream(stream: openai.AsyncStream) -> None:
    async for _ in stream:
        pass
