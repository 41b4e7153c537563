"""One log line per distinct problem per minute, with a count, instead of a line (or a traceback) per event: what
the gateway logs about requests that do not parse, a replica that is down, and a state store that is down.

Each test repeats the failing event for a few minutes of a fake clock against real components (the gateway on a
loopback port, a gRPC state server, an aiohttp replica, a Redis port nobody listens on) and counts the lines.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from kvgate.clock import FakeClock
from kvgate.state.redis_store import RedisStateStore
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from kvgate.router.load_readers import watch_stream
from kvgate.router.observations import ObservationPublisher
from kvgate.router.probes import HttpTarget, health_loop
from tests.eventually import eventually
from tests.gateway_harness import running_gateway
from tests.malformed_http import MALFORMED, SECRET, send_malformed, send_raw
from tests.registry_docs import static_model
from tests.services import free_loopback_port


def messages(caplog: pytest.LogCaptureFixture, logger: str, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= level]


# ------------------------------------------------------------------------------ malformed requests


async def test_fifty_malformed_requests_are_one_warning_per_kind_without_traceback_or_headers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    (tmp_path / "m.yaml").write_text(static_model("http://127.0.0.1:9"))
    clock = FakeClock()
    async with running_gateway(tmp_path, clock=clock) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        statuses = await send_malformed("127.0.0.1", port, 50)
        lines = messages(caplog, "aiohttp.server")
        kinds = {line.partition(": ")[2].split(",")[0] for line in lines}  # "LineTooLong", ...
        # Each malformed request still gets its 400 (or a reset, for the oversized header)...
        assert all(status.endswith(b" 400 Bad Request") or status == b"" for status in statuses), statuses
        # ... but the log has one line per kind of error, where it had an ERROR traceback per request.
        assert len(lines) == len(kinds) <= len(MALFORMED), lines
        assert all(line.startswith("malformed HTTP request from 127.0.0.1: ") for line in lines), lines
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records
                   if r.name == "aiohttp.server")
        assert SECRET not in caplog.text and "Traceback" not in caplog.text

        await clock.advance(60.0)  # a minute on, the next of a kind says how many were not logged
        await send_raw("127.0.0.1", port, MALFORMED[1])  # a header line too long: 9 of the 50 were
        [again] = messages(caplog, "aiohttp.server")[len(lines):]
        assert again == "malformed HTTP request from 127.0.0.1: LineTooLong, answered 400 (8 more in the last 60 s)"


# ------------------------------------------------------------------------------ a replica that is down


async def test_a_dead_engines_state_stream_is_said_once_a_minute_and_once_when_it_is_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """An engine gone for 150 s is tried every 5 s (30 connections refused): three lines, not thirty; and one
    when a server answers on its port again."""
    caplog.set_level(logging.INFO, logger="kvgate.router.load_readers")
    clock, port = FakeClock(), free_loopback_port()
    disconnects: list[float] = []
    reports: list[float] = []
    task = asyncio.create_task(watch_stream(f"127.0.0.1:{port}", clock, lambda r: reports.append(clock.now()),
                                            lambda: disconnects.append(clock.now())))
    server = grpc.aio.server()
    try:
        for tries in range(1, 31):
            await eventually(lambda tries=tries: len(disconnects) == tries and clock.num_sleepers == 1)
            await clock.advance(5.0)  # past the longest back-off
        await eventually(lambda: len(disconnects) == 31 and clock.num_sleepers == 1)  # tries at t=0, 5, ..., 150
        lines = messages(caplog, "kvgate.router.load_readers")
        assert len(lines) == 3, lines  # at t=0, 60 and 120
        assert all(line.startswith(f"state stream 127.0.0.1:{port}: UNAVAILABLE ") for line in lines)
        assert lines[1].endswith(" (11 more in the last 60 s)"), lines

        replica_pb2_grpc.add_ReplicaServicer_to_server(_OneSnapshot(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await clock.advance(5.0)
        await eventually(lambda: reports)
        [back] = messages(caplog, "kvgate.router.load_readers")[3:]
        assert back.startswith(f"state stream 127.0.0.1:{port} delivers again after ")
        assert back.endswith("after 155.0 s and 31 failed connection(s)"), back
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)


class _OneSnapshot(replica_pb2_grpc.ReplicaServicer):
    async def WatchState(self, request, context):  # noqa: N802 (the RPC's name)
        yield replica_pb2.ReplicaState(replica_id="r", seq=1)
        await asyncio.Event().wait()


async def test_failing_health_checks_are_said_once_a_minute_and_once_when_they_pass(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica answering 503 to 30 health checks 5 s apart, then 200."""
    caplog.set_level(logging.DEBUG, logger="kvgate.router.probes")
    status = [503]
    app = web.Application()

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=status[0])

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    clock, results = FakeClock(), []
    async with aiohttp.ClientSession() as session:
        target = HttpTarget(url=f"http://127.0.0.1:{runner.addresses[0][1]}", session=lambda: session,
                            headers=lambda: None, timeout_s=2.0, name="m-static-0")
        task = asyncio.create_task(health_loop(target, clock, 5.0, results.append))
        try:
            for checks in range(1, 31):
                await eventually(lambda checks=checks: len(results) == checks and clock.num_sleepers == 1)
                if checks < 30:
                    await clock.advance(5.0)
            status[0] = 200
            await clock.advance(5.0)
            await eventually(lambda: results[-1])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()
    lines = messages(caplog, "kvgate.router.probes")
    assert lines == ["health check of replica m-static-0 failed: HTTP 503",
                     "health check of replica m-static-0 failed: HTTP 503 (11 more in the last 60 s)",
                     "health check of replica m-static-0 failed: HTTP 503 (11 more in the last 60 s)",
                     "health check of replica m-static-0 passes again after 150.0 s and 30 failure(s)"]


# ------------------------------------------------------------------------------ a state store that is down


async def test_the_observation_publisher_says_a_store_outage_once_a_minute_with_the_count(
        caplog: pytest.LogCaptureFixture) -> None:
    """13 publishes 10 s apart to a Redis port nobody listens on: lines at t=0, 60 and 120."""
    caplog.set_level(logging.INFO, logger="kvgate.router.observations")
    clock = FakeClock()
    store = RedisStateStore.from_url(f"redis://:hunter2@127.0.0.1:{free_loopback_port()}/0", clock, timeout_s=0.5)
    publisher = ObservationPublisher(store=store, gateway_id="gw", clock=clock, model_names=lambda: ["m"],
                                     arrivals={"m": 0}, queued=lambda model: 0, in_flight=dict,
                                     ttft_p99_s=dict, interval_s=10.0)
    task = asyncio.create_task(publisher.run())
    try:
        for _ in range(13):
            await eventually(lambda: clock.num_sleepers == 1)
            await clock.advance(10.0)
        await eventually(lambda: clock.num_sleepers == 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()
    lines = messages(caplog, "kvgate.router.observations")
    assert len(lines) == 3, lines
    assert lines[1].endswith("(failing for 60 s; 5 more failed tries since the last line)"), lines[1]
    assert "hunter2" not in caplog.text and "Traceback" not in caplog.text
