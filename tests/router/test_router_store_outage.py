"""A `kvgate router` started before its Redis (a Kubernetes gateway pod scheduled ahead of the Redis
StatefulSet): it serves its static replicas at once, says once that the store cannot be reached (then at most
once a minute, not at each poll), naming it without its password and with no traceback, and says once that it
is back.

Every process is real: the gateway, a simulated replica (static), and a redis-server with a password
started on the port the gateway was told about, part-way through.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest

from loadtests.sim_replica import SimReplicaConfig, start_sim_replica
from tests.eventually import eventually
from tests.registry_docs import static_model
from tests.services import asks_for_a_password, free_loopback_port, http_answers, kvgate_command, running

POLL_INTERVAL_S = 1.0  # the gateway's membership poll (ReplicaTracker's default)
PASSWORD = "hunter2"
MEMBERSHIP_WARNING = "WARNING kvgate.router.replicas: membership poll failed"
RECOVERED = "INFO kvgate.router.replicas: membership poll works again"
PUBLISHING_AGAIN = "INFO kvgate.router.observations: publishing observations to the state store again after"


def stamps(log: str, marker: str) -> list[float]:
    """Seconds (since the epoch, local time) of each log line holding `marker`; the format is the CLI's
    `%(asctime)s`, "2026-01-02 03:04:05,678"."""
    found = []
    for line in log.splitlines():
        if marker in line:
            found.append(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return found


async def chat(session: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


async def test_a_gateway_started_before_redis_serves_static_replicas_and_logs_the_outage_once(
        tmp_path: Path) -> None:
    sim = await start_sim_replica(SimReplicaConfig(model="m"))
    (tmp_path / "registry.yaml").write_text(static_model(sim.url))
    redis_port, port = free_loopback_port(), free_loopback_port()
    state = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"  # nothing listens there yet
    shown = f"redis://:***@127.0.0.1:{redis_port}/0"
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "router.log"
    command = [*kvgate_command(), "router", "--registry", str(tmp_path), "--port", str(port), "--state", state]
    try:
        with running(command, name="kvgate router", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                     log_path=log_path):
            async with aiohttp.ClientSession() as session:
                statuses = []
                await eventually(lambda: MEMBERSHIP_WARNING in log_path.read_text(), poll_s=0.1)
                outage_until = time.monotonic() + 5 * POLL_INTERVAL_S  # five more polls that fail
                while time.monotonic() < outage_until:
                    statuses.append(await chat(session, url))
                    await asyncio.sleep(0.1)
                assert statuses and set(statuses) == {200}  # the static replica serves all along

                binary = shutil.which("redis-server")
                if binary is None:
                    pytest.fail("redis-server not found; `make test` installs it", pytrace=False)
                redis_command = [binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--requirepass", PASSWORD, "--dir", str(tmp_path)]
                with running(redis_command, name="redis-server", timeout_s=10, log_path=tmp_path / "redis.log",
                             ready=lambda: asks_for_a_password(redis_port)):
                    await eventually(lambda: RECOVERED in log_path.read_text(),  # the next poll, ~1 s away
                                     lambda: f"{RECOVERED!r} in the log:\n{log_path.read_text()[-2000:]}", poll_s=0.1)
                    # Two more polls, both quiet. A successful poll logs nothing, so there is no signal to wait
                    # for: a slow host runs fewer polls here, which can only hide a repeated line, never fail.
                    await asyncio.sleep(2.5 * POLL_INTERVAL_S)
                    assert await chat(session, url) == 200
    finally:
        await sim.close()

    log = log_path.read_text()
    # One line when the outage began, not one per poll (about six failed here): the next would come a minute on.
    assert len(stamps(log, MEMBERSHIP_WARNING)) == 1
    assert len(stamps(log, RECOVERED)) == 1
    [recovered] = [line for line in log.splitlines() if RECOVERED in line]
    num_tries = int(recovered.split(" failed tr")[0].rsplit(" ", 1)[1])
    assert num_tries >= 4, recovered  # every failed poll counted: 5 s of polls a second, and the first
    assert len(stamps(log, PUBLISHING_AGAIN)) == 1
    lines = [line for line in log.splitlines() if MEMBERSHIP_WARNING in line]
    assert all(shown in line and "unreachable: Error 111" in line and "routing to 1 static" in line
               for line in lines), lines[0]
    assert "Traceback" not in log and PASSWORD not in log
    # Everything else the outage logged: the observation publisher's one line when it began (and one when it ended).
    others = [line for line in log.splitlines() if " WARNING " in line and MEMBERSHIP_WARNING not in line]
    assert len(others) <= 1 and all("cannot publish observations" in line for line in others), others
