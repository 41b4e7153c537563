"""The gateway in front of two real `kvgate engine` processes on builtin:tiny-llama.

The engines are registry static replicas with backend `kvgate` and a `grpc_target`, so their load
comes from the engine's WatchState stream; they start once for the module (a few seconds each) and
every test builds a fresh in-process gateway over them. Health checks run every 60 s, as in
test_gateway.py, so nothing but requests and the state stream moves during a test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from kvgate.clock import RealClock
from registry.watch import RegistryWatcher
from router.app import GatewaySettings, build_app
from router.proxy import REPLICA_HEADER
from router.replicas import ReplicaTracker
from tests.services import free_loopback_port
from tests.engine_server.test_process import SERVED, Replica, start_replica, stop

# ~2,100 characters: dozens of 16-token KV blocks, so a repeat has a prefix the engine can serve from cache.
LONG_PROMPT = "You are a careful assistant for the kvgate project, answering in short sentences. " * 26
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Engine:
    replica: Replica
    grpc_target: str

    @property
    def url(self) -> str:
        return self.replica.url

    def metric(self, name: str) -> float:
        return self.replica.metric(name)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    work = tmp_path_factory.mktemp("engines")
    grpc_ports = [free_loopback_port(), free_loopback_port()]
    with ThreadPoolExecutor(2) as pool:  # both start at once: startup is mostly waiting on imports
        replicas = list(pool.map(lambda port: start_replica(work, "--grpc-port", str(port), "--kv-cache-bytes",
                                                            "4MiB"), grpc_ports))
    try:
        yield [Engine(r, f"127.0.0.1:{p}") for r, p in zip(replicas, grpc_ports)]
    finally:
        for replica in replicas:
            stop(replica)


@dataclass
class Gateway:
    url: str
    client: openai.AsyncOpenAI
    tracker: ReplicaTracker

    async def admin_stats(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/admin/stats") as r:
            return await r.json()


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, engines: list[Engine]) -> AsyncIterator[Gateway]:
    static = ", ".join(f"{{url: '{e.url}', backend: kvgate, grpc_target: '{e.grpc_target}'}}" for e in engines)
    (tmp_path / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {SERVED}}}
spec:
  source: builtin:tiny-llama
  routing: {{prefix_chunk_chars: 64, static_replicas: [{static}]}}
""")
    clock = RealClock()
    watcher = await RegistryWatcher.open(tmp_path, clock)
    tracker = ReplicaTracker(clock=clock, poll_interval_s=60.0, health_interval_s=60.0)
    runner = web.AppRunner(build_app(GatewaySettings(), tracker, watcher, clock), handler_cancellation=True,
                           access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    try:
        await eventually(lambda: all(r.kv_blocks_total > 0 for r in tracker.view(SERVED).replicas))  # streams up
        yield Gateway(url, client, tracker)
    finally:
        await client.close()
        await runner.cleanup()


async def eventually(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def engine_at(engines: list[Engine], url: str) -> Engine:
    return next(e for e in engines if e.url == url)


async def test_the_openai_sdk_streams_and_not_through_the_gateway(tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        reply = await gw.client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **GREEDY)
        assert reply.object == "chat.completion" and reply.usage.completion_tokens == 4
        stream = await gw.client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 5
        assert chunks[-2].choices[0].finish_reason == "length"
        text = await gw.client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, stream=True, **GREEDY)
        assert sum(1 for c in [c async for c in text] if c.choices and c.choices[0].text is not None) >= 3


async def test_a_repeated_long_prompt_stays_on_one_engine_and_hits_its_cache(tmp_path: Path,
                                                                          engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        served_by, cached = set(), []
        for _ in range(4):
            raw = await gw.client.completions.with_raw_response.create(
                model=SERVED, prompt=LONG_PROMPT, max_tokens=2, **GREEDY)
            served_by.add(raw.headers[REPLICA_HEADER])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        assert len(served_by) == 1
        assert all(c > 0 for c in cached[1:]), cached
        # The gateway learnt tiny-llama's characters per token from usage.prompt_tokens: 4 answers
        # move the estimate from 4.0 by 1 - 0.9^4 of the way to the real ratio.
        ratio = len(LONG_PROMPT) / raw.parse().usage.prompt_tokens
        assert ratio < 3.5  # tiny-llama's small vocabulary: far fewer characters per token than 4
        assert gw.tracker.chars_per_token_of(SERVED) == pytest.approx(ratio + (4.0 - ratio) * 0.9 ** 4, rel=0.02)


async def test_a_client_that_drops_a_stream_aborts_it_in_the_engine(tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        aborted_before = {e.url: e.metric("kvgate_engine_requests_aborted_total") for e in engines}
        body = {"model": SERVED, "prompt": "Count slowly", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            response = await s.post(gw.url + "/v1/completions", json=body)
            assert response.status == 200
            await response.content.readline()
            engine = engine_at(engines, response.headers[REPLICA_HEADER])
            response.close()  # the client goes away after the first event
        aborted = "kvgate_engine_requests_aborted_total"
        await eventually(lambda: engine.metric(aborted) > aborted_before[engine.url])
        await eventually(lambda: engine.metric("kvgate_engine_kv_blocks_free")
                         == engine.metric("kvgate_engine_kv_blocks_total"))


async def test_engine_load_reaches_admin_stats_over_the_grpc_stream(tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        body = {"model": SERVED, "prompt": "Count slowly", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=body) as response:
            await response.content.readline()
            busy = response.headers[REPLICA_HEADER]
            for _ in range(200):
                replicas = {r["replica_id"]: r for r in (await gw.admin_stats())["models"][SERVED]["replicas"]}
                if replicas[busy]["num_running"] == 1:
                    break
                await asyncio.sleep(0.05)
            assert replicas[busy]["num_running"] + replicas[busy]["num_waiting"] == 1
            assert replicas[busy]["kv_blocks_free"] < replicas[busy]["kv_blocks_total"]
            idle = next(r for rid, r in replicas.items() if rid != busy)
            assert idle["num_running"] == 0 and idle["kv_blocks_total"] > 0
            assert replicas[busy]["prefix_capacity_chunks"] == replicas[busy]["kv_blocks_total"] * 16 * 4 // 64
            response.close()
