"""A replica frozen in the middle of requests (SIGSTOP, as a hung GPU driver leaves one): the gateway gives up on
the requests in flight there once its health checks go unanswered (`TrackerSettings.interrupt_after_unanswered_checks`
in a row), not at the 120 s first-byte or 60 s idle timeout; a non-streamed request is answered by another replica,
a stream gets its SSE error event. A replica that is slow (a long prefill) but answers its health checks keeps its
requests, and so does one that answers them too late but still delivers. Over `loadtests/sim_replica.py`
processes, so the freeze is a real one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.router.proxy import REPLICA_HEADER
from kvgate.router.replicas import ReplicaTracker
from tests.eventually import eventually
from tests.gateway_harness import running_gateway
from tests.router.sim_gateway import chat, static_id, write_registry
from tests.services import free_loopback_port, http_answers, running

SIM = Path(__file__).resolve().parents[2] / "loadtests" / "sim_replica.py"
# Health checks every 1 s, each given 1 s (probe_timeout_s): a frozen replica leaves rotation at its first
# unanswered check and loses its requests, silent since the freeze, at the first unanswered check from the second
# on that finds them silent for interrupt_after_silent_s (5 s): at most max(2 x (1 + 1), 5 + 1 + 1) = 7 s after it.
HEALTH_INTERVAL_S = 1.0
# Far under the 120 s first-byte and 60 s idle timeouts that were the answer before, far over the 7 s above plus
# a 2 s retry on a loaded 2-core host.
PROMPT_WITHIN_S = 20.0
WAIT_S = 40.0  # how long a test waits for the answer before failing: it fails here, not at the old timeouts


@contextlib.contextmanager
def sim_processes(tmp_path: Path, count: int, *options: str) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """`count` sim replicas of model m, each in a process of its own: [(url, process)]."""
    with contextlib.ExitStack() as stack:
        sims = []
        for i in range(count):
            port = free_loopback_port()
            url = f"http://127.0.0.1:{port}"
            process = stack.enter_context(running(
                [sys.executable, str(SIM), "--port", str(port), "--model", "m", *options], name=f"sim {i}",
                ready=lambda url=url: http_answers(url + "/health"), timeout_s=60.0, log_path=tmp_path / f"sim{i}.log"))
            sims.append((url, process))
        yield sims


@contextlib.contextmanager
def frozen(process: subprocess.Popen) -> Iterator[float]:
    """SIGSTOP `process` for the block (yields when, on the monotonic clock); SIGCONT however the block ends."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(process.pid, signal.SIGCONT)


def busy_replica(tracker: ReplicaTracker) -> str | None:
    """The id of the one replica of m with a request in flight, else None."""
    busy = [r.replica_id for r in tracker.view("m").replicas if r.in_flight]
    return busy[0] if len(busy) == 1 else None


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def test_a_request_in_flight_on_a_frozen_replica_is_answered_by_another_within_seconds(tmp_path: Path) -> None:
    # 20 tokens at 10 per second: each attempt takes 2 s, so the request is still in flight when the freeze comes
    with sim_processes(tmp_path, 2, "--decode-tokens-per-s", "10") as sims:
        urls = [url for url, _ in sims]
        write_registry(tmp_path, urls)
        async with running_gateway(tmp_path, health_interval_s=HEALTH_INTERVAL_S) as (url, tracker), \
                aiohttp.ClientSession() as session:
            async def ask() -> tuple[int, dict[str, str], str]:
                body = chat("a question for whichever replica " * 10, max_tokens=20)
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    return r.status, dict(r.headers), await r.text()

            request = asyncio.create_task(ask())
            busy = await eventually(lambda: busy_replica(tracker))
            process = next(p for u, p in sims if static_id(urls, u) == busy)
            with frozen(process) as frozen_at:
                status, headers, text = await asyncio.wait_for(request, WAIT_S)
                answered_in_s = time.monotonic() - frozen_at
            exported = await metrics(url)
    assert status == 200, text
    assert headers[REPLICA_HEADER] != busy  # the other replica answered
    assert answered_in_s < PROMPT_WITHIN_S
    assert json.loads(text)["usage"]["completion_tokens"] == 20
    # given up once on the frozen one, never sent there again
    assert f'kvgate_router_requests_total{{model="m",outcome="replica_unhealthy",replica="{busy}"}} 1.0' in exported


async def test_a_stream_in_flight_on_a_frozen_replica_ends_with_its_error_event_within_seconds(
        tmp_path: Path) -> None:
    # 400 tokens at 20 per second: the stream would run 20 s
    with sim_processes(tmp_path, 1, "--decode-tokens-per-s", "20") as sims:
        (sim_url, process), = sims
        write_registry(tmp_path, [sim_url])
        async with running_gateway(tmp_path, health_interval_s=HEALTH_INTERVAL_S) as (url, tracker), \
                aiohttp.ClientSession() as session:
            body = chat("stream me something long", max_tokens=400, stream=True)
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                first = await asyncio.wait_for(r.content.readline(), WAIT_S)
                assert first.startswith(b"data: {")  # the client has its first event: nothing can be retried now
                with frozen(process) as frozen_at:
                    rest = await asyncio.wait_for(r.content.read(), WAIT_S)
                    ended_in_s = time.monotonic() - frozen_at
    events = [e.strip() for e in rest.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_unhealthy" and "health checks" in error["message"]
    assert ended_in_s < PROMPT_WITHIN_S


async def test_a_replica_that_is_slow_but_answers_its_health_checks_keeps_its_requests(tmp_path: Path) -> None:
    # 2 x ~300 prompt tokens at 100 per second: 6 s of prefill before the first byte, longer than it takes to give up on
    # a frozen replica (4 s), while its /health answers at once
    with sim_processes(tmp_path, 1, "--prefill-tokens-per-s", "100", "--no-prefix-caching") as sims:
        (sim_url, _), = sims
        write_registry(tmp_path, [sim_url])
        checks: list[float] = []  # when the gateway's health checks got their answers
        trace = aiohttp.TraceConfig()

        async def on_request_end(session: object, context: object, params: aiohttp.TraceRequestEndParams) -> None:
            if params.url.path == "/health" and params.response.status == 200:
                checks.append(time.monotonic())

        trace.on_request_end.append(on_request_end)
        async with aiohttp.ClientSession(trace_configs=[trace]) as http, \
                running_gateway(tmp_path, http=http, health_interval_s=HEALTH_INTERVAL_S) as (url, tracker), \
                aiohttp.ClientSession() as session:
            async def ask(stream: bool) -> tuple[int, str]:
                body = chat(f"a long prompt, streamed={stream} " * 40, max_tokens=4, stream=stream)
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    return r.status, await r.text()

            started = time.monotonic()
            answers = await asyncio.wait_for(asyncio.gather(ask(False), ask(True)), WAIT_S)
            took_s = time.monotonic() - started
            exported = await metrics(url)
    (status, text), (stream_status, stream_text) = answers
    assert took_s > 5.0  # it was slow ...
    assert len([t for t in checks if started < t < started + took_s]) >= 3  # ... and answered its checks meanwhile
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4
    assert stream_status == 200 and stream_text.endswith("data: [DONE]\n\n") and '"error"' not in stream_text
    assert "replica_unhealthy" not in exported


@contextlib.asynccontextmanager
async def late_health_replica(health_delay_s: float, num_tokens: int, token_every_s: float
                              ) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A replica on loopback whose chat completions stream `num_tokens` events, one every `token_every_s`, and whose
    /health answers 200, once the event it yields with its URL is set only after `health_delay_s` (a busy event
    loop, a GC pause)."""
    busy = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        if busy.is_set():
            await asyncio.sleep(health_delay_s)
        return web.json_response({"status": "ok"})

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(num_tokens):
            delta = json.dumps({"id": "x", "object": "chat.completion.chunk",
                                "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
            await response.write(f"data: {delta}\n\n".encode())
            await asyncio.sleep(token_every_s)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat_completions)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", busy
    finally:
        await runner.cleanup()


async def test_a_stream_that_still_delivers_is_never_cut_however_late_the_health_checks_are_answered(
        tmp_path: Path) -> None:
    # /health answers after 1.5 s, past its 1 s probe timeout: every check goes unanswered. The stream sends a token
    # every 200 ms for 8 s, twice as long as two unanswered checks take (2 x (1 + 1) = 4 s, where it was cut before).
    async with late_health_replica(health_delay_s=1.5, num_tokens=40, token_every_s=0.2) as (replica_url, busy):
        write_registry(tmp_path, [replica_url])
        async with running_gateway(tmp_path, health_interval_s=HEALTH_INTERVAL_S, poll_interval_s=1.0) as (
                url, tracker), aiohttp.ClientSession() as session:
            unanswered: list[int] = []  # the replica's count of unanswered checks, sampled while the stream runs

            async def sample() -> None:
                while True:
                    unanswered.append(tracker._replicas[static_id([replica_url], replica_url)].health.unanswered_checks)
                    await asyncio.sleep(0.1)

            sampler = asyncio.create_task(sample())
            try:
                body = chat("stream while busy", max_tokens=40, stream=True)
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    busy.set()
                    status, text = r.status, await asyncio.wait_for(r.text(), WAIT_S)
            finally:
                sampler.cancel()
            exported = await metrics(url)
    assert status == 200 and '"error"' not in text and text.endswith("data: [DONE]\n\n")
    assert text.count('"delta"') == 40  # every token came
    assert "replica_unhealthy" not in exported
    assert max(unanswered) >= 2  # its checks went unanswered, enough in a row to give up on a frozen replica
