"""The `kvgate router` process itself: what it does on SIGTERM, against a simulated replica on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from pathlib import Path

import aiohttp
import openai
import pytest
import redis.asyncio
import redis.exceptions

from loadtests.sim_replica import SimReplicaConfig, start_sim_replica
from loadtests.sim_replica_model import SchedulerSpec
from kvgate.clock import RealClock
from kvgate.state.base import MemberRecord
from kvgate.state.base import ReplicaState as MemberState
from kvgate.state.redis_store import RedisStateStore
from kvgate.router.proxy import REPLICA_HEADER
from tests.eventually import eventually
from tests.registry_docs import local_pool, static_model
from tests.metrics_text import samples, value
from tests.services import free_loopback_port, http_answers, kvgate_command, redis_server, running

SLOW_SIM = SchedulerSpec(prefill_tokens_per_s=1e6, decode_tokens_per_s=20.0)  # 40 tokens: a 2 s stream


async def http_get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


async def test_sigterm_drains_in_flight_streams_refuses_new_requests_and_exits_zero(tmp_path: Path) -> None:
    sim = await start_sim_replica(SimReplicaConfig(model="m", scheduler=SLOW_SIM))
    (tmp_path / "registry.yaml").write_text(static_model(sim.url))
    port = free_loopback_port()
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*kvgate_command(), "router", "--registry", str(tmp_path), "--port", str(port),
                                    "--drain-timeout-s", "20"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    try:
        async def healthy() -> bool:
            assert process.poll() is None, log_path.read_text()
            try:
                return (await http_get(url + "/health"))[0] == 200
            except aiohttp.ClientError:
                return False
        await eventually(healthy, lambda: f"the router answers /health:\n{log_path.read_text()[-3000:]}",
                         poll_s=0.05)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a long answer"}], max_tokens=40, stream=True)
        chunks = [await anext(aiter(stream))]
        process.send_signal(signal.SIGTERM)

        async def health_once_refused() -> dict | None:
            status, health = await http_get(url + "/health")
            return health if status == 503 else None
        health = await eventually(health_once_refused, "/health answers 503 once SIGTERM is in")
        assert health["status"] == "draining"  # load balancers stop sending here
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"]
        assert json.loads(refused.value.response.text)["error"]["code"] == "draining"
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            exported = samples(await r.text())  # the refusal is an answer too (the error ratio's denominator)
        assert value(exported, "kvgate_router_answers_total", model="_unknown", code="5xx") == 1
        chunks += [chunk async for chunk in stream]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"  # not cut short
        assert await asyncio.to_thread(process.wait, 30) == 0
        assert "kvgate router stopped" in log_path.read_text()
    finally:
        await client.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        await sim.close()


MEMBERS_ONLY = """apiVersion: kvgate/v1
kind: Model
metadata: {name: m}
spec:
  source: builtin:tiny-llama
  scaling: {max_queue_wait_s: 1}
---
"""


async def chat(url: str) -> tuple[int, dict, str | None]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json(), r.headers.get(REPLICA_HEADER)


async def test_replicas_keep_serving_when_their_membership_lapses_or_redis_goes_away(tmp_path: Path) -> None:
    """`kvgate router --state redis://`: replicas come from the autoscaler's membership records. When
    those stop being renewed (the autoscaler crashed, or a standby has not taken over yet) or Redis itself
    goes away, a replica that still answers keeps getting requests; once it stops answering it is dropped."""
    sim = await start_sim_replica(SimReplicaConfig(model="m"))
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "models.yaml").write_text(MEMBERS_ONLY + local_pool(tmp_path / "work"))
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    with redis_server(tmp_path) as state:
        store = RedisStateStore.from_url(state, RealClock())
        command = [*kvgate_command(), "router", "--registry", str(tmp_path / "registry"), "--port", str(port),
                   "--state", state]
        log_path = tmp_path / "router.log"
        try:
            with running(command, name="kvgate router", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                         log_path=log_path):
                await store.put_member(MemberRecord(replica_id="m-1", model="m", url=sim.url,
                                                    state=MemberState.READY), ttl_s=3.0)

                async def replicas() -> list[dict]:
                    return (await http_get(url + "/admin/stats"))[1]["models"]["m"]["replicas"]
                await eventually(replicas, "the member in the gateway (it polls the store every second)",
                                 poll_s=0.1)
                assert (await chat(url))[0] == 200

                async def lapsed() -> bool:
                    return not await store.list_members()
                await eventually(lapsed, "the record to lapse (3 s TTL): nobody renews it", poll_s=0.1)

                async def unlisted() -> bool:
                    return (await replicas())[0]["unlisted_s"] is not None
                await eventually(unlisted, "the gateway's next membership poll to find it gone", poll_s=0.1)
                status, _, replica = await chat(url)
                assert (status, replica) == (200, "m-1")
                assert (await replicas())[0]["unlisted_s"] > 0
                async with redis.asyncio.Redis.from_url(state) as client:
                    with contextlib.suppress(redis.exceptions.ConnectionError):
                        await client.shutdown(nosave=True)
                assert (await chat(url))[:3:2] == (200, "m-1")  # the store is gone: the last known members stay
                await sim.close()  # and now the replica is gone too
                await eventually(lambda: "replica m-1 dropped" in log_path.read_text(),  # 3 failed checks, ~6 s
                                 "a replica that stopped answering to be dropped", timeout_s=60, poll_s=0.1)
                status, body, _ = await chat(url)
                assert status == 503 and body["error"]["code"] == "no_capacity"
            log = log_path.read_text()
            assert "replica m-1 left the membership list while serving" in log
            assert "(3 failed health checks in a row)" in log
        finally:
            await store.close()
            await sim.close()


def test_bad_durations_are_one_usage_line_naming_the_option(tmp_path: Path) -> None:
    for option, value, says in (("--member-grace-s", "-1", "must be >= 0 seconds"),
                                ("--drain-timeout-s", "soon", "'soon' is not a number of seconds"),
                                ("--member-grace-s", "nan", "must be >= 0 seconds")):
        done = subprocess.run([*kvgate_command(), "router", "--registry", str(tmp_path), option, value],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and f"argument {option}: {says}" in done.stderr
        assert "Traceback" not in done.stderr
