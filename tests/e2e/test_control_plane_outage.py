"""The data path outlives the control path: `kvgate autoscaler` killed with SIGKILL (a crashed pod, a lost
node) while `kvgate router` serves the replica it started, every process real: redis-server, both kvgate
commands, and a `kvgate engine` the local provider started on builtin tiny-llama.

The autoscaler renews each replica's membership record every tick with a 10 s TTL. Once it is dead the
records expire; the replica does not. The gateway must keep sending it requests (it still passes health
checks) until a new autoscaler takes the lease, adopts the replica and lists it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import aiohttp

from kvgate.clock import RealClock
from kvgate.state import RedisStateStore
from tests.eventually import eventually
from tests.registry_docs import local_pool, tiny_llama
from tests.services import free_loopback_port, http_answers, kvgate_command, running


def kvgate(*args: str) -> list[str]:
    return [*kvgate_command(), *args]


async def chat(session: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


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
            await eventually(served, "the first replica to serve", timeout_s=120, poll_s=0.2)  # ~6 s to load tiny-llama
            [member] = await store.list_members()

            autoscalers[0].kill()  # no lease release, no goodbye: its records just stop being renewed
            autoscalers[0].wait()
            async def the_replica() -> dict:
                async with session.get(url + "/admin/stats") as response:
                    [replica] = (await response.json())["models"]["tiny-llama"]["replicas"]
                return replica

            statuses = []

            async def lapsed_under_traffic() -> bool:  # a request every 0.2 s until the record (10 s TTL) lapsed
                statuses.append(await chat(session, url))  # and the gateway's membership poll saw it go
                return not await store.list_members() and (await the_replica())["unlisted_s"] is not None
            await eventually(lapsed_under_traffic, "the record to lapse and the gateway to notice", poll_s=0.2)
            assert statuses == [200] * len(statuses)  # no request noticed
            replica = await the_replica()
            assert replica["replica_id"] == member.replica_id and replica["unlisted_s"] > 0

            with open(tmp_path / "autoscaler-2.log", "wb") as log:
                autoscalers.append(subprocess.Popen([*autoscale, "--holder", "second"], stdout=log,
                                                    stderr=subprocess.STDOUT))

            async def listed_again() -> bool:
                return (await the_replica())["unlisted_s"] is None
            await eventually(listed_again, "the new autoscaler to list the replica again", timeout_s=60, poll_s=0.2)
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
