"""The gateway end to end: the official openai SDK -> kvgate router -> simulated replicas on real sockets
(`tests.router.sim_gateway`): the API, affinity and the prefix index, bad input, waiting at zero replicas,
/v1/models, /admin/stats and /metrics. Replicas that misbehave: test_gateway_failures.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvgate.clock import FakeClock, RealClock
from loadtests.sim_replica import SimReplicaConfig, start_sim_replica
from kvgate.registry.loader import load_registry
from kvgate.state.memory import MemoryStateStore
from kvgate.router.app import GatewaySettings
from kvgate.router.observations import OBSERVATIONS_COLLECTION
from kvgate.router.common_openings import MIN_REQUESTS
from kvgate.router.prefix_index import CACHE_EVIDENCE_MIN
from kvgate.router.proxy import REPLICA_HEADER
from tests.eventually import eventually
from tests.gateway_harness import running_gateway
from tests.router.sim_gateway import (
    FAST_SIM, LONG_PROMPT, OTHER_LONG_PROMPT, POOL, Gateway, admin_replica, answer_with_usage, chat, drain_stream,
    gateway, hand_written_replica, write_registry)


async def test_non_streamed_chat_passes_through_the_sdk(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        reply = await gw.client.chat.completions.create(**chat("hello"))
        assert reply.object == "chat.completion"
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens == 4


async def test_streamed_chat_and_completions_pass_through_the_sdk(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        stream = await gw.client.chat.completions.create(**chat("hello"), stream=True)
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        text = await gw.client.completions.create(model="sql", prompt="SELECT", max_tokens=3, stream=True)
        assert len([c async for c in text]) == 3


async def test_a_prompt_whose_tokens_are_mostly_not_its_text_keeps_its_realised_cached_tokens(tmp_path: Path) -> None:
    async def answer(request: web.Request) -> web.Response:  # two images: thousands of tokens, few characters
        await request.read()
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [],
                                  "usage": {"prompt_tokens": 5400, "prompt_tokens_details": {"cached_tokens": 5300}}})

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            status, _, _ = await gw.post("/v1/chat/completions", json.dumps(chat("Compare these photos.")).encode())
            assert status == 200
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                exported = await r.text()
            assert gw.tracker.chars_per_token_of("m") > 3  # 5,400 tokens for ~30 characters teach nothing
    assert 'kvgate_router_prefix_realised_tokens_total{model="m"} 5300.0' in exported


async def test_a_server_run_with_an_api_key_gets_it_from_the_gateways_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    async def guarded(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer s3cret":  # as vLLM's --api-key answers
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async with hand_written_replica(chat_completions=guarded) as url:
        for key, status in ((None, 401), ("s3cret", 200)):
            if key is None:
                monkeypatch.delenv("KVGATE_TEST_REPLICA_KEY", raising=False)
            else:
                monkeypatch.setenv("KVGATE_TEST_REPLICA_KEY", key)
            (tmp_path / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: m}}
spec:
  source: builtin:tiny-llama
  routing: {{static_replicas: [{{url: '{url}', backend: vllm, api_key_env: KVGATE_TEST_REPLICA_KEY}}]}}
---
{POOL}""")
            async with running_gateway(tmp_path) as (gateway_url, _):
                async with aiohttp.ClientSession() as s, s.post(gateway_url + "/v1/chat/completions",
                                                                json=chat("x")) as r:
                    assert r.status == status  # without the key the server's 401 passes through
                async with aiohttp.ClientSession() as s, s.get(gateway_url + "/admin/stats") as r:
                    assert "s3cret" not in await r.text()
    assert seen == [None, "Bearer s3cret"]


async def test_one_request_id_reaches_the_replica_comes_back_and_names_the_decision(tmp_path: Path) -> None:
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("X-Request-Id"))
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            body = json.dumps(chat("x")).encode()
            _, given, _ = await gw.post("/v1/chat/completions", body, {"X-Request-Id": "client-42"})
            _, made, _ = await gw.post("/v1/chat/completions", body)
            _, unusable, _ = await gw.post("/v1/chat/completions", body, {"X-Request-Id": "x" * 200})
            status, unknown, _ = await gw.post("/v1/chat/completions", json.dumps(chat("x") | {"model": "no"}).encode(),
                                               {"X-Request-Id": "client-43"})
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/stats") as r:
                decisions = (await r.json())["recent_decisions"]
    def request_id(headers: dict[str, str]) -> str:
        return next(value for name, value in headers.items() if name.lower() == "x-request-id")

    assert request_id(given) == "client-42"
    assert len(request_id(made)) == 32 and len(request_id(unusable)) == 32  # made up by the gateway
    assert seen == ["client-42", request_id(made), request_id(unusable)]
    assert status == 404 and request_id(unknown) == "client-43"  # errors carry it too
    assert [d["request_id"] for d in decisions][:3] == seen


async def test_the_body_reaches_the_replica_byte_for_byte(tmp_path: Path) -> None:
    captured: list[bytes] = []

    async def capture(request: web.Request) -> web.Response:
        captured.append(await request.read())
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    raw = json.dumps(chat("exact bytes", vendor_field={"kept": True}), indent=3).encode()
    async with hand_written_replica(chat_completions=capture) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            status, _, _ = await gw.post("/v1/chat/completions", raw, {"Content-Type": "application/json"})
    assert status == 200
    assert captured == [raw]


async def test_a_repeated_long_prompt_returns_to_its_replica_and_hits_the_cache(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        replicas, cached = set(), []
        for _ in range(4):
            raw = await gw.client.chat.completions.with_raw_response.create(**chat(LONG_PROMPT))
            replicas.add(raw.headers[REPLICA_HEADER])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        assert len(replicas) == 1
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])
        # The prompt came back: it is that replica's working set, which operators see in /admin/stats.
        (home,) = replicas
        entries = (await admin_replica(gw, home))["prefix_index_entries"]
        assert (await admin_replica(gw, home))["prefix_working_set_chunks"] == entries > 0
        others = [r.replica_id for r in gw.tracker.view("m").candidates("m") if r.replica_id != home]
        assert [(await admin_replica(gw, rid))["prefix_working_set_chunks"] for rid in others] == [0, 0]


async def test_distinct_prompts_that_share_only_an_opening_every_request_has_spread_over_the_replicas(
        tmp_path: Path) -> None:
    # One at a time, so no queue ever forms: the first replica to hold the shared opening would otherwise
    # take every prompt (16 x the opening cheaper there), as sglang-router's first worker took 12 of 12.
    opening = "A preamble that every request of this deployment opens with, well past one chunk. " * 2
    replicas = []
    async with gateway(tmp_path) as gw:
        for i in range(MIN_REQUESTS + 20):
            raw = await gw.client.chat.completions.with_raw_response.create(
                **chat(opening + f"request {i}: " + "distinct text " * 4))
            replicas.append(raw.headers[REPLICA_HEADER])
    assert len(set(replicas[MIN_REQUESTS:])) == 3  # once the opening is common to nearly all of them


async def test_a_prompt_the_replica_evicted_stays_in_its_index_after_the_miss_that_computed_it_again(
        tmp_path: Path) -> None:
    # A plain OpenAI server (backend: openai, no load read) gets the default index, far bigger than this
    # one's 40 blocks (640 tokens), so the index still believes in the first prompt after a second one
    # evicted it there.
    spec = replace(FAST_SIM, kv_capacity_tokens=640)
    async with gateway(tmp_path, num_replicas=1, sim_spec=spec) as gw:
        (replica_id,) = [r.replica_id for r in gw.tracker.view("m").candidates("m")]
        index = gw.tracker.prefixes.get(replica_id)

        async def cached_tokens(content: str) -> int:
            reply = await gw.client.chat.completions.create(**chat(content))
            return reply.usage.prompt_tokens_details.cached_tokens

        assert await cached_tokens(LONG_PROMPT) == 0
        assert await cached_tokens(LONG_PROMPT) > 400  # it caches
        await cached_tokens(OTHER_LONG_PROMPT)  # evicts the first there
        entries = len(index)
        assert await cached_tokens(LONG_PROMPT) < 400  # predicted whole, realised less...
        assert index.stats().num_corrections_total == 1
        assert len(index) == entries  # ...and kept: that miss put it back
        assert await cached_tokens(LONG_PROMPT) > 400


async def test_a_replica_with_prefix_caching_off_loses_its_chains_once_its_hits_never_realise(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A plain OpenAI server (backend: openai): only its responses tell.
    async with gateway(tmp_path, num_replicas=1, sim_spec=replace(FAST_SIM, prefix_caching=False)) as gw:
        (replica_id,) = [r.replica_id for r in gw.tracker.view("m").candidates("m")]
        index = gw.tracker.prefixes.get(replica_id)
        assert (await admin_replica(gw, replica_id))["prefix_caching"] == "on"  # assumed until shown otherwise
        with caplog.at_level(logging.WARNING, logger="kvgate.router.proxy"):
            for _ in range(CACHE_EVIDENCE_MIN + 1):
                reply = await gw.client.chat.completions.create(**chat(LONG_PROMPT))
                assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert not index.caches()
        assert len(index) == 0  # the last predicted hit, realised 0, dropped the chain
        # The operator sees the judgement, once in the log and in /admin/stats.
        said = [r.getMessage() for r in caplog.records if "no cached tokens" in r.getMessage()]
        assert len(said) == 1 and replica_id in said[0]
        assert (await admin_replica(gw, replica_id))["prefix_caching"] == "not_observed"


async def test_a_replica_that_says_prefix_caching_is_off_never_gets_a_predicted_hit(tmp_path: Path) -> None:
    # vllm:cache_config_info{enable_prefix_caching="False"}, as vLLM --no-enable-prefix-caching exports it
    spec = replace(FAST_SIM, prefix_caching=False)
    async with gateway(tmp_path, num_replicas=1, sim_spec=spec, backend="vllm") as gw:
        (replica_id,) = [r.replica_id for r in gw.tracker.view("m").candidates("m")]
        index = gw.tracker.prefixes.get(replica_id)
        await eventually(lambda: index.capacity == 0)  # from its first /metrics scrape
        for _ in range(3):
            await gw.client.chat.completions.create(**chat(LONG_PROMPT))
        stats = gw.tracker.prefixes.get(replica_id).stats()
        assert (stats.capacity_chunks, stats.num_entries, stats.predicted_cached_tokens_total) == (0, 0, 0)
        assert (await admin_replica(gw, replica_id))["prefix_caching"] == "off"


async def test_a_replicas_answer_keeps_its_own_content_type(tmp_path: Path) -> None:
    async def plain_400(request: web.Request) -> web.Response:
        return web.Response(status=400, text="prompt too long", content_type="text/plain")

    async def html_503(request: web.Request) -> web.Response:
        return web.Response(status=503, text="<h1>overloaded</h1>", content_type="text/html")

    async with hand_written_replica(chat_completions=plain_400, completions=html_503) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            status, headers, text = await gw.post("/v1/chat/completions", json.dumps(chat("hi")).encode())
            assert (status, headers["Content-Type"], text) == (400, "text/plain; charset=utf-8", "prompt too long")
            body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()
            status, headers, text = await gw.post("/v1/completions", body)  # a 5xx, passed on after the retries
            assert (status, headers["Content-Type"], text) == (503, "text/html; charset=utf-8", "<h1>overloaded</h1>")


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_type"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "missing"),
    (json.dumps({"model": 7, "messages": []}).encode(), 400, "invalid_type"),
    (json.dumps({"model": "m"}).encode(), 400, "missing"),
    (json.dumps(chat("x") | {"model": "nope"}).encode(), 404, "model_not_found"),
    (json.dumps(chat("x" * 5000)).encode(), 413, "request_too_large"),
    (b"[" * 2000 + b"]" * 2000, 400, "invalid_json"),  # past the parser's recursion limit, inside the body limit
    (json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode(), 400, "missing"),
    (json.dumps({"model": "m", "messages": [{"role": 5, "content": "x"}]}).encode(), 400, "invalid_type"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "invalid_json"),  # no text
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, "invalid_json"),  # nor this
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}]}'.encode("utf-16"), 400, "invalid_json"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "invalid_json"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', 400, "invalid_json"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1e999}', 400, "invalid_json"),
])
async def test_bad_input_gets_an_openai_error_object(tmp_path: Path, body: bytes, status: int, code: str) -> None:
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(max_body_bytes=4096)) as gw:
        got, _, text = await gw.post("/v1/chat/completions", body)
        assert got == status
        error = json.loads(text)["error"]
        assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
        if body == b"[1, 2]":  # the gateway's own words for it, as its clients have seen them
            assert error["message"] == "the request body must be a JSON object, not list"


async def test_a_completions_request_without_prompt_is_400(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        status, _, text = await gw.post("/v1/completions", json.dumps({"model": "m"}).encode())
        assert status == 400 and json.loads(text)["error"]["param"] == "prompt"


async def queue_depth(gw: Gateway, model: str) -> float:
    """The gateway's exported wait-queue depth of `model` (0 before any request waited)."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    prefix = f'kvgate_router_queue_depth{{model="{model}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def test_at_zero_replicas_a_request_waits_then_gets_503_with_retry_after(tmp_path: Path) -> None:
    clock = FakeClock()  # the model's 0.3 s wait limit runs out when the test moves time, not before
    async with gateway(tmp_path, num_replicas=1, clock=clock) as gw:
        body = json.dumps(chat("x") | {"model": "cold"}).encode()
        first = asyncio.create_task(gw.post("/v1/chat/completions", body))
        await eventually(lambda: queue_depth(gw, "cold"), "the first request waits in cold's queue")
        await clock.advance(0.25)
        status_full, headers_full, _ = await gw.post("/v1/chat/completions", body)  # queue of 1 is full
        assert status_full == 503 and "Retry-After" in headers_full
        assert await queue_depth(gw, "cold") == 1  # 0.25 s into its 0.3 s wait, the first still waits
        await clock.advance(0.1)
        status, headers, text = await first
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert json.loads(text)["error"]["code"] == "no_capacity"


async def test_requests_waiting_at_zero_replicas_are_published_for_the_autoscaler(tmp_path: Path) -> None:
    clock = FakeClock()  # publishes every 0.05 s of it; the 0.3 s wait limit runs out only when moved past
    store = MemoryStateStore(RealClock())
    settings = GatewaySettings(gateway_id="gw-a", observation_interval_s=0.05)
    async with gateway(tmp_path, num_replicas=1, settings=settings, store=store, clock=clock) as gw:
        body = json.dumps(chat("x") | {"model": "cold"}).encode()
        waiting = asyncio.create_task(gw.post("/v1/chat/completions", body))
        await eventually(lambda: queue_depth(gw, "cold"), "the request waits in cold's queue")
        await clock.advance(0.05)  # the next publish

        async def published_waiting() -> dict | None:
            record = await store.get_record(OBSERVATIONS_COLLECTION, "cold@gw-a")
            return record.data if record is not None and record.data["queued"] == 1 else None
        observation = await eventually(published_waiting, "an observation of cold with one request queued")
        assert observation["arrivals_per_s"] > 0
        await clock.advance(1.0)
        status, _, _ = await waiting
        assert status == 503
    assert await store.list_records(OBSERVATIONS_COLLECTION) == []  # withdrawn when the gateway stopped


async def test_a_waiting_request_is_served_once_a_replica_appears(tmp_path: Path) -> None:
    clock = FakeClock()  # the request's 0.3 s wait limit never runs out: only the replica can end its wait
    async with gateway(tmp_path, num_replicas=1, clock=clock) as gw:
        cold = await start_sim_replica(SimReplicaConfig(model="cold", scheduler=FAST_SIM))
        try:
            waiting = asyncio.create_task(gw.client.chat.completions.create(**chat("x") | {"model": "cold"}))
            await eventually(lambda: queue_depth(gw, "cold"), "the request waits in cold's queue")
            text = (tmp_path / "registry.yaml").read_text()
            (tmp_path / "registry.yaml").write_text(text.replace(
                "routing: {max_queued_requests: 1}",
                f"routing: {{max_queued_requests: 1, static_replicas: [{{url: '{cold.url}'}}]}}"))
            gw.tracker.update_registry(load_registry(tmp_path))  # what the registry watcher does on reload
            reply = await waiting
            assert reply.model == "cold"
        finally:
            await cold.close()


async def test_models_lists_models_and_adapters(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        models = {m.id: m for m in (await gw.client.models.list()).data}
        assert set(models) == {"m", "cold", "sql"}
        assert models["sql"].model_extra["parent"] == "m"


async def test_admin_stats_needs_the_token(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=2, settings=GatewaySettings(admin_token="s3cret")) as gw:
        await gw.client.chat.completions.create(**chat(LONG_PROMPT))
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/admin/stats") as r:
                assert r.status == 401
            async with s.get(gw.url + "/admin/stats", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            async with s.get(gw.url + "/admin/stats", headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200
                stats = await r.json()
        model = stats["models"]["m"]
        assert model["adapters"] == ["sql"] and len(model["replicas"]) == 2
        assert stats["recent_decisions"][0]["reason"] == "rendezvous"
        assert sum(r["prefix_index_entries"] for r in model["replicas"]) > 0


async def test_metrics_expose_the_router_series(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        stream = await gw.client.chat.completions.create(**chat(LONG_PROMPT), stream=True,
                                                         stream_options={"include_usage": True})
        await drain_stream(stream)
        await gw.client.chat.completions.create(**chat(LONG_PROMPT))
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            text = await r.text()
        for name in ("kvgate_router_requests_total", "kvgate_router_decisions_total",
                     "kvgate_router_decision_seconds_bucket", "kvgate_router_ttft_seconds_bucket",
                     "kvgate_router_prefix_predicted_tokens_total", "kvgate_router_prefix_realised_tokens_total",
                     "kvgate_router_in_flight", "kvgate_router_queue_depth"):
            assert name in text, name
        assert 'kvgate_router_replicas{model="m",state="ready"} 1.0' in text
        await gw.sims[0].close()
        gw.tracker._apply_health(gw.id_of(gw.sims[0]), False)  # what the next health check finds
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            after = await r.text()
        assert 'kvgate_router_replicas{model="m",state="unhealthy"} 1.0' in after
        assert 'kvgate_router_replicas{model="m",state="ready"} 0.0' in after  # an alert on ready == 0 fires
        assert 'kvgate_router_replicas{model="cold",state="ready"} 0.0' in after  # a model with no replica too
        assert f'kvgate_router_requests_total{{model="m",outcome="success",replica="m-static-0"}} 2.0' in text
        realised = next(line for line in text.splitlines()
                        if line.startswith('kvgate_router_prefix_realised_tokens_total{model="m"}'))
        assert float(realised.split()[-1]) > 0


async def test_a_replica_that_does_not_report_cached_tokens_leaves_the_realised_rate_unknown_not_zero(
        tmp_path: Path) -> None:
    """vLLM leaves usage.prompt_tokens_details out unless run with --enable-prompt-tokens-details. The gateway
    still counts what it predicted; it counts nothing as realised, and no prompt as reported on."""
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer_with_usage('{"prompt_tokens": 500, "completion_tokens": 1}'),
                            content_type="application/json")

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            for _ in range(3):  # the second and third are predicted hits on the one replica
                status, _, _ = await gw.post("/v1/chat/completions", json.dumps(chat(LONG_PROMPT)).encode())
                assert status == 200
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                exported = await r.text()

    def total(name: str) -> float:
        lines = [line for line in exported.splitlines() if line.startswith(f'{name}_total{{model="m"}}')]
        return float(lines[0].split()[-1]) if lines else 0.0
    assert total("kvgate_router_prefix_predicted_tokens") > 500  # two prompts mostly predicted cached
    assert total("kvgate_router_prefix_realised_tokens") == 0
    assert total("kvgate_router_prefix_reported_prompt_tokens") == 0  # the realised rate's denominator
    assert "# TYPE kvgate_router_prefix_reported_prompt_tokens_total counter" in exported  # registered


async def test_a_replica_that_left_loses_its_metric_series_after_the_grace_period(tmp_path: Path) -> None:
    clock = FakeClock()  # the 0.3 s grace runs on it: the series stays until the test moves time past it
    settings = GatewaySettings(retire_replica_series_after_s=0.3)
    async with gateway(tmp_path, num_replicas=2, settings=settings, clock=clock) as gw:
        kept, left = gw.sims
        kept_id, left_id = gw.id_of(kept), gw.id_of(left)  # "m-static-0", "m-static-1"
        for i in range(12):  # distinct openings: rendezvous places them on both
            await gw.client.chat.completions.create(**chat(f"question {i} " + LONG_PROMPT))

        async def exported() -> str:
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                return await r.text()

        assert f'replica="{left_id}"' in await exported() and f'replica="{kept_id}"' in await exported()
        write_registry(tmp_path, [kept.url])
        gw.tracker.update_registry(load_registry(tmp_path))  # what the registry watcher does on reload
        await clock.advance(0.2)
        assert f'replica="{left_id}"' in await exported()  # scrapes still read its last counts for a while
        await clock.advance(0.5)  # past the grace, with the retirement check every 0.075 s on the way

        async def left_series_gone() -> bool:
            return f'replica="{left_id}"' not in await exported()
        await eventually(left_series_gone, "the series of the replica that left are dropped")
        assert f'replica="{kept_id}"' in await exported()
        assert left_id not in gw.tracker.replica_ids()


async def test_pending_prefill_lasts_until_the_first_token_and_the_chain_until_the_end(tmp_path: Path) -> None:
    # A backend that opens every stream with a role-only chunk at once and sends the token only when
    # told: the gateway must count the prompt as waiting for prefill until that token. A second role-only
    # chunk, sent once the client has the first, reaches the client only after the gateway has handled
    # the first one: the point at which pending prefill is checked.
    role_read, release = asyncio.Event(), asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(role)}\n\n".encode())
        await role_read.wait()
        await response.write(f"data: {json.dumps(role)}\n\n".encode())
        await release.wait()
        token = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "length"}]}
        await response.write(f"data: {json.dumps(token)}\n\ndata: [DONE]\n\n".encode())
        return response

    async with hand_written_replica(chat_completions=completions) as backend, \
            gateway(tmp_path, num_replicas=0, other_urls=(backend,)) as gw:
        try:
            def pending() -> int:
                return sum(r.pending_prefill_tokens for r in gw.tracker.view("m").candidates("m"))

            (replica_id,) = [r.replica_id for r in gw.tracker.view("m").candidates("m")]
            async with aiohttp.ClientSession() as s:
                r = await s.post(gw.url + "/v1/chat/completions", json=chat(LONG_PROMPT, stream=True))
                for _ in range(2):
                    assert json.loads((await r.content.readline())[5:])["choices"][0]["delta"]["role"] == "assistant"
                    assert await r.content.readline() == b"\n"
                    role_read.set()
                assert pending() > 400  # ~2,000 characters of prompt still to prefill
                # its prefix chain counts as in flight there (what tells a hot prefix) until it ends
                assert gw.tracker.in_flight_chains.num_hashes(replica_id) > 5
                release.set()
                assert b"[DONE]" in await r.read()
            assert pending() == 0
            assert gw.tracker.in_flight_chains.num_hashes(replica_id) == 0
        finally:
            role_read.set()  # before the replica shuts down, which waits for its handler
            release.set()


async def test_routed_prompts_are_published_as_work_for_the_autoscaler(tmp_path: Path) -> None:
    """Two requests routed through a real gateway: the prompt tokens they must prefill reach the observation
    record, for the autoscaler's work model (`autoscaler.work`), and so do the two requests finishing (with those in
    flight, Little's law's time in service)."""
    clock = FakeClock()
    store = MemoryStateStore(RealClock())
    settings = GatewaySettings(gateway_id="gw-a", observation_interval_s=0.05)
    async with gateway(tmp_path, num_replicas=1, settings=settings, store=store, clock=clock) as gw:
        for text in ("a prompt of some length " * 20, "another one"):
            status, _, _ = await gw.post("/v1/chat/completions", json.dumps(chat(text)).encode())
            assert status == 200

        async def published_work() -> dict | None:
            await clock.advance(0.05)
            record = await store.get_record(OBSERVATIONS_COLLECTION, "m@gw-a")
            return record.data if record is not None and record.data["prompt_tokens_per_s"] > 0 else None
        observation = await eventually(published_work, "an observation of m with prompt work")
        tokens, squares = observation["prompt_tokens_per_s"], observation["prompt_tokens_sq_per_s"]
        assert squares > tokens * tokens / observation["arrivals_per_s"] > 0  # two unequal prompts: E[P^2] > E[P]^2
        assert observation["completions_per_s"] == pytest.approx(observation["arrivals_per_s"])  # both finished
        assert observation["in_flight"] == 0
