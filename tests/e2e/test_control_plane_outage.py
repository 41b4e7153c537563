"""The data path outlives the control path: `kvgate autoscaler` killed with SIGKILL (a crashed pod, a lost
node) while `kvgate router` serves the replica it started, every process real: redis-server, both kvgate
commands, and a `kvgate engine` the local provider started on builtin tiny-llama.

The autoscaler renews each replica's membership record every tick with a 10 s TTL. Once it is dead the
records expire; the replica does not. The gateway must keep sending it requests (it still passes health
checks) until a new autoscaler takes the lease, adopts the replica and lists it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import aiohttp

from kvgate.clock import RealClock
from kvgate.state import RedisStateStore
from tests.registry_docs import local_pool, tiny_llama
from tests.services import free_loopback_port, http_answers, kvgate_command, running


def kvgate(*args: str) -> list[str]:
    return [*kvgate_command(), *args]


async def chat(session: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


async def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_a_killed_autoscaler_costs_no_request_while_its_replica_runs(tmp_path: Path, redis_url: str) -> None:
    work_dir = tmp_path / "work"
    (tmp_path / "registry").mkdir()
    registry = tiny_llama("min_replicas: 1, max_replicas: 1, max_queue_wait_s: 5") + local_pool(work_dir)
    (tmp_path / "registry" / "r.yaml").write_text(registry)
    prefix = f"outage-{uuid.uuid4().hex[:8]}:"
    state = ["--state", redis_url, "--key-prefix", prefix]
    autoscale = kvgate("autoscaler", "--registry", str(tmp_path / "registry"), *state, "--cluster", "outage",
                       "--interval-s", "0.5")
    store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    autoscalers: list[subprocess.Popen] = []
    sessions: list[aiohttp.ClientSession] = []
    try:
        with open(tmp_path / "autoscaler-1.log", "wb") as log:
            autoscalers.append(subprocess.Popen([*autoscale, "--holder", "first"], stdout=log,
                                                stderr=subprocess.STDOUT))
        with running(kvgate("router", "--registry", str(tmp_path / "registry"), "--port", str(port), *state),
                     name="kvgate router", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                     log_path=tmp_path / "router.log"):
            session = aiohttp.ClientSession()
            sessions.append(session)

            async def served() -> bool:
                return await chat(session, url) == 200
            await until(served, 120, "the first replica to serve")  # ~6 s to load tiny-llama on 2 cores
            [member] = await store.list_members()

            autoscalers[0].kill()  # no lease release, no goodbye: its records just stop being renewed
            autoscalers[0].wait()
            statuses = []
            killed_at = time.monotonic()
            while time.monotonic() - killed_at < 13.0:  # past the records' 10 s TTL
                statuses.append(await chat(session, url))
                await asyncio.sleep(0.2)
            assert await store.list_members() == []  # the record expired ...
            assert statuses == [200] * len(statuses)  # ... and no request noticed
            async with session.get(url + "/admin/stats") as response:
                [replica] = (await response.json())["models"]["tiny-llama"]["replicas"]
            assert replica["replica_id"] == member.replica_id and replica["unlisted_s"] > 0

            with open(tmp_path / "autoscaler-2.log", "wb") as log:
                autoscalers.append(subprocess.Popen([*autoscale, "--holder", "second"], stdout=log,
                                                    stderr=subprocess.STDOUT))

            async def listed_again() -> bool:
                async with session.get(url + "/admin/stats") as response:
                    [replica] = (await response.json())["models"]["tiny-llama"]["replicas"]
                return replica["unlisted_s"] is None

            await until(listed_again, 60, "the new autoscaler to list the replica again")
            assert [m.replica_id for m in await store.list_members()] == [member.replica_id]  # adopted, not replaced
            assert await chat(session, url) == 200
            autoscalers[1].send_signal(signal.SIGTERM)
            assert autoscalers[1].wait(timeout=30) == 0
        assert "is listed again" in (tmp_path / "router.log").read_text()
    finally:
        for process in autoscalers:
            if process.poll() is None:
                process.kill()
                process.wait()
        await store.close()
        for session in sessions:
            await session.close()
        for record in (work_dir / "replicas").glob("*.json") if (work_dir / "replicas").exists() else ():
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.killpg(json.loads(record.read_text())["pgid"], signal.SIGKILL)  # the engine the test left
