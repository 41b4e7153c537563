"""The gateway when replicas misbehave: failures before the first byte are retried elsewhere, never on
the replica that failed; a stream that breaks ends with an error event; stalls time out; impossible
usage figures and oversized answers cost neither the request nor the gateway; a client that goes away
aborts its upstream request. Over simulated replicas with failure injection (`tests.router.sim_gateway`)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from loadtests.sim_replica_model import SchedulerSpec
from kvgate.router import proxy as proxy_module
from kvgate.router.proxy import REPLICA_HEADER
from tests.eventually import eventually
from tests.router.sim_gateway import answer_with_usage, chat, drain_stream, gateway, hand_written_replica


@pytest.mark.parametrize("body", [
    answer_with_usage('{"prompt_tokens": "many", "prompt_tokens_details": {"cached_tokens": -5}}'),  # not counts
    answer_with_usage('{"prompt_tokens": 1e30, "prompt_tokens_details": {"cached_tokens": 1e30}}'),
    answer_with_usage(f'{{"prompt_tokens": {10**30}, "prompt_tokens_details": {{"cached_tokens": {10**30}}}}}'),
    answer_with_usage('{"prompt_tokens": 3, "extra": ' + "[" * 3000 + "]" * 3000 + "}"),  # past json's recursion limit
])
async def test_a_replicas_impossible_usage_neither_fails_the_request_nor_skews_the_hit_figures(
        tmp_path: Path, body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            for _ in range(2):
                status, _, text = await gw.post("/v1/chat/completions", json.dumps(chat("hello " * 50)).encode())
                assert status == 200 and text.encode() == body  # passed through as the replica sent it
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                exported = await r.text()
    realised = [float(line.split()[-1]) for line in exported.splitlines()
                if line.startswith('kvgate_router_prefix_realised_tokens_total{model="m"}')]
    assert all(0 <= value <= 2 * 300 for value in realised)  # two prompts of ~300 characters, at most all cached
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_answer_too_big_to_hold_is_a_502_not_a_gateway_out_of_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_module, "MAX_ANSWER_BYTES", 64 * 1024)

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"pad": "' + b"x" * 200_000 + b'"}', content_type="application/json")

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            status, _, text = await gw.post("/v1/chat/completions", json.dumps(chat("x")).encode())
    assert status == 502 and "over 65536 bytes" in json.loads(text)["error"]["message"]


async def test_a_failing_replica_is_retried_elsewhere_and_never_twice(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        await gw.fail(gw.sims[0], mode="error500")
        await gw.fail(gw.sims[1], mode="refuse")
        for i in range(6):
            before = [(await gw.stats(s))["num_failures_injected"] for s in gw.sims[:2]]
            raw = await gw.client.chat.completions.with_raw_response.create(**chat(f"distinct prompt {i} " * 20))
            assert raw.headers[REPLICA_HEADER] == gw.id_of(gw.sims[2])
            after = [(await gw.stats(s))["num_failures_injected"] for s in gw.sims[:2]]
            assert all(a - b <= 1 for a, b in zip(after, before)), "a failed replica was tried twice"
        # every attempt's prefix chain left the in-flight count, the failed ones too
        assert [gw.tracker.in_flight_chains.num_hashes(gw.id_of(s)) for s in gw.sims] == [0, 0, 0]


async def test_when_every_replica_fails_the_upstream_error_passes_through(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=2) as gw:
        for sim in gw.sims:
            await gw.fail(sim, mode="error500")
        with pytest.raises(openai.InternalServerError) as caught:
            await gw.client.chat.completions.create(**chat("doomed"))
        assert caught.value.status_code == 500
        assert "injected failure" in caught.value.message
        assert sum([(await gw.stats(s))["num_failures_injected"] for s in gw.sims]) == 2


async def test_a_stream_that_dies_mid_way_ends_with_an_error_event_then_done(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        await gw.fail(gw.sims[0], mode="die_mid_stream", die_after_chunks=2)
        body = json.dumps(chat("die", stream=True, max_tokens=8)).encode()
        status, headers, text = await asyncio.wait_for(gw.post("/v1/chat/completions", body), 5.0)
        assert status == 200
        events = [e for e in text.split("\n\n") if e]
        assert len(events) == 4  # two chunks from the replica, the error, [DONE]
        assert json.loads(events[2].removeprefix("data: "))["error"]["code"] == "stream_broken"
        assert events[3] == "data: [DONE]"
        with pytest.raises(openai.APIError):  # the SDK surfaces it instead of hanging
            stream = await gw.client.chat.completions.create(**chat("die"), stream=True)
            await asyncio.wait_for(drain_stream(stream), 5.0)


async def test_a_stalled_replica_is_left_after_the_first_byte_timeout(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=2, routing=", first_byte_timeout_s: 0.3") as gw:
        await gw.fail(gw.sims[0], mode="stall")
        for i in range(3):
            raw = await gw.client.chat.completions.with_raw_response.create(**chat(f"stall {i}"))
            assert raw.headers[REPLICA_HEADER] == gw.id_of(gw.sims[1])


async def test_a_stall_with_nowhere_to_retry_is_a_504(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1, routing=", first_byte_timeout_s: 0.3") as gw:
        await gw.fail(gw.sims[0], mode="stall")
        status, _, text = await gw.post("/v1/chat/completions", json.dumps(chat("x")).encode())
        assert status == 504
        assert json.loads(text)["error"]["code"] == "upstream_timeout"


async def test_a_client_that_goes_away_aborts_the_upstream_request(tmp_path: Path) -> None:
    slow = SchedulerSpec(prefill_tokens_per_s=1e6, decode_tokens_per_s=20.0)  # 200 tokens: 10 s
    async with gateway(tmp_path, num_replicas=1, sim_spec=slow) as gw:
        async with aiohttp.ClientSession() as s:
            r = await s.post(gw.url + "/v1/chat/completions", json=chat("bye " * 50, stream=True, max_tokens=200))
            await r.content.readline()
            r.close()  # the client leaves after the first event

        async def aborted() -> bool:
            return (await gw.stats(gw.sims[0]))["num_aborted"] >= 1
        await eventually(aborted, "the replica aborted the request")
        assert (await gw.stats(gw.sims[0]))["num_aborted"] == 1
        assert gw.tracker.in_flight_chains.num_hashes(gw.id_of(gw.sims[0])) == 0  # no longer counted in flight
