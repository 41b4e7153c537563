"""The gateway's /metrics as an operator's Prometheus reads it (issue 29): every inference request counted once by how
it ended, end-to-end and inter-token latency, tokens by model and adapter, per-model series present from the start,
and no `_created` series."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import Histogram, generate_latest

from kvgate.openai_wire import ApiError
from kvgate.registry.loader import load_registry
from kvgate.router.metrics import ANSWER_CODES, RouterMetrics
from kvgate.router.proxy import REPLICA_HEADER, STREAM_OUTCOME_KEY, InterTokenClock
from kvgate.router.usage import answer_code
from tests.metrics_text import samples, value
from tests.router.sim_gateway import LONG_PROMPT, chat, drain_stream, gateway, hand_written_replica, write_registry


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_each_request_is_counted_once_by_how_it_ended_with_its_latency_and_tokens(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        stream = await gw.client.chat.completions.create(**chat(LONG_PROMPT), stream=True,
                                                         stream_options={"include_usage": True})
        await drain_stream(stream)
        answer = await gw.client.chat.completions.create(**chat(LONG_PROMPT, model="sql"))
        assert (await gw.post("/v1/chat/completions", b"{not json"))[0] == 400
        assert (await gw.post("/v1/chat/completions", json.dumps(chat("hi", model="nope")).encode()))[0] == 404
        assert (await gw.post("/v1/chat/completions", json.dumps(chat("hi", n=0)).encode()))[0] == 400
        exported = samples(text := await scrape(gw.url))

    assert not [line for line in text.splitlines() if "_created" in line]
    assert value(exported, "kvgate_router_answers_total", model="m", code="2xx") == 2
    assert value(exported, "kvgate_router_answers_total", model="m", code="4xx") == 1  # n=0, refused at m
    assert value(exported, "kvgate_router_answers_total", model="_unknown", code="4xx") == 2  # bad JSON, no such model
    assert value(exported, "kvgate_router_answers_total", model="m", code="5xx") == 0
    assert value(exported, "kvgate_router_e2e_seconds_count", model="m") == 2
    # The adapter's answer counts under the base model and the adapter, the stream's under the base alone.
    completion_sql = value(exported, "kvgate_router_tokens_total", model="m", adapter="sql", kind="completion")
    assert completion_sql == answer.usage.completion_tokens
    assert value(exported, "kvgate_router_tokens_total", model="m", adapter="", kind="completion") > 0
    assert value(exported, "kvgate_router_tokens_total", model="m", adapter="sql",
                 kind="prompt") == answer.usage.prompt_tokens
    assert value(exported, "kvgate_router_prefix_estimated_prompt_tokens_total", model="m") > 0
    # "cold" had no request: its per-model series are there, at zero, from the start.
    for name in ("kvgate_router_in_flight", "kvgate_router_queue_depth", "kvgate_router_e2e_seconds_count", "kvgate_router_itl_seconds_count",
                 "kvgate_router_prefix_predicted_tokens_total", "kvgate_router_prefix_estimated_prompt_tokens_total"):
        assert value(exported, name, model="cold") == 0, name
    for code in ANSWER_CODES:
        assert value(exported, "kvgate_router_answers_total", model="cold", code=code) == 0
    assert value(exported, "kvgate_router_tokens_total", model="cold", adapter="", kind="prompt") == 0
    assert value(exported, "kvgate_router_state_store_up") == 1


async def test_inter_token_latency_is_the_time_between_streamed_tokens(tmp_path: Path) -> None:
    """Five tokens 50 ms apart, then the finish, the usage and [DONE] in one write: four gaps of ~50 ms, and the
    events that carry no token (role, finish, usage) add none."""
    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def delta(**fields: object) -> bytes:
        return event({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": fields}]})

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(delta(role="assistant", content=""))
        for i in range(5):
            await asyncio.sleep(0.05)
            await response.write(delta(content=f"t{i} "))
        await response.write(event({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                             + event({"id": "x", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5,
                                                                          "total_tokens": 14}})
                             + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            stream = await gw.client.chat.completions.create(**chat("hello"), stream=True)
            await drain_stream(stream)
            exported = samples(await scrape(gw.url))
    assert value(exported, "kvgate_router_itl_seconds_count", model="m") == 4
    assert 0.15 < value(exported, "kvgate_router_itl_seconds_sum", model="m") < 1.0
    assert value(exported, "kvgate_router_itl_seconds_bucket", model="m", le="0.01") == 0
    assert value(exported, "kvgate_router_tokens_total", model="m", adapter="", kind="completion") == 5
    assert value(exported, "kvgate_router_answers_total", model="m", code="2xx") == 1


async def test_a_client_that_closes_at_done_had_its_whole_answer(tmp_path: Path) -> None:
    """Many clients close their connection once they read [DONE]. The replica here sends the stream's end (the
    chunked terminator) 0.5 s after [DONE]: the client is gone by then, and the answer still counts as a whole one
    (2xx, success, its tokens), not `client_gone`. It counted as gone while the gateway read that end in the
    request's own handler."""
    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
        usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: " + json.dumps(usage).encode()
                             + b"\n\ndata: [DONE]\n\n")
        await asyncio.sleep(0.5)
        await response.write_eof()
        return response

    async with hand_written_replica(chat_completions=answer) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            host, port = gw.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = json.dumps(chat("hello", stream=True)).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            received = b""
            while b"[DONE]" not in received:
                received += await asyncio.wait_for(reader.read(65536), 5)
            writer.close()  # at [DONE], before the replica's stream has ended
            await asyncio.sleep(1.0)
            exported = samples(await scrape(gw.url))
    assert b" 200 " in received.split(b"\r\n")[0]
    assert value(exported, "kvgate_router_answers_total", model="m", code="2xx") == 1
    assert value(exported, "kvgate_router_answers_total", model="m", code="client_gone") == 0
    assert [key for key in exported if key[0] == "kvgate_router_requests_total"
            and ("outcome", "client_gone") in key[1]] == []
    assert value(exported, "kvgate_router_tenant_requests_total", tenant="_open", model="m", outcome="success") == 1
    assert value(exported, "kvgate_router_tokens_total", model="m", adapter="", kind="completion") == 1


async def test_a_body_refused_before_its_handler_runs_is_an_answer_too(tmp_path: Path) -> None:
    """A body refused at `Expect: 100-continue` (413, before the handler runs) is an inference request: in
    answers_total beside refused_requests_total (a refusal while draining: tests/router/test_router_process.py)."""
    async with gateway(tmp_path, num_replicas=1) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 999999999\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        exported = samples(await scrape(gw.url))
    assert b" 413 " in status_line
    assert value(exported, "kvgate_router_answers_total", model="_unknown", code="4xx") == 1
    assert value(exported, "kvgate_router_refused_requests_total", model="_unknown", reason="too_large",
                 status="413", tenant="_none") == 1


def test_events_read_together_share_the_time_since_the_last_read() -> None:
    histogram = Histogram("itl", "", buckets=(0.01, 0.1, 1.0))
    clock = InterTokenClock(histogram)
    clock.tokens_at(2, now=10.0)  # the first read with tokens: nothing before it to measure from
    clock.tokens_at(2, now=10.5)  # a read with no new token (a finish event): no gap
    clock.tokens_at(4, now=11.0)  # two tokens 1 s after the last: 0.5 s each
    clock.tokens_at(5, now=11.05)
    counts = {s.labels.get("le"): s.value for s in histogram.collect()[0].samples if s.name == "itl_bucket"}
    assert counts == {"0.01": 0, "0.1": 1, "1.0": 3, "+Inf": 3}
    assert next(s.value for s in histogram.collect()[0].samples if s.name == "itl_sum") == pytest.approx(1.05)


def test_the_per_token_histogram_exports_what_prometheus_clients_would() -> None:
    """`ModelHistogram` (a bisection per observation) against prometheus_client's Histogram, values on bounds too."""
    from prometheus_client import CollectorRegistry

    from kvgate.router.metrics import ModelHistogram

    bounds = (0.01, 0.1, 1.0)
    ours, reference = ModelHistogram("h_seconds", "h", bounds), CollectorRegistry()
    theirs = Histogram("h_seconds", "h", ["model"], buckets=bounds, registry=reference)
    for value_s in (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 3.0, 3.0):
        ours.labels("m").observe(value_s)
        theirs.labels("m").observe(value_s)
    ours.labels("idle")
    theirs.labels("idle")
    registry = CollectorRegistry()
    registry.register(ours)
    exported = samples(generate_latest(registry).decode())
    expected = {key: v for key, v in samples(generate_latest(reference).decode()).items()
                if not key[0].endswith("_created")}
    assert exported == expected
    assert value(exported, "h_seconds_bucket", model="m", le="0.01") == 2  # 0.01 itself is <= 0.01


def stream_response(outcome: str | None, status: int = 200) -> web.StreamResponse:
    response = web.StreamResponse(status=status)
    if outcome is not None:
        response[STREAM_OUTCOME_KEY] = outcome
    return response


@pytest.mark.parametrize(("response", "error", "code"), [
    (stream_response(None), None, "2xx"),
    (stream_response("success"), None, "2xx"),
    (stream_response(None, 404), None, "4xx"),  # a replica's own 4xx, passed through
    (stream_response(None, 502), None, "5xx"),
    (stream_response("timeout"), None, "stream_error"),  # went out as 200, then broke
    (stream_response("client_gone"), None, "client_gone"),
    (None, ApiError(429, "slow down", type="RateLimitError"), "4xx"),
    (None, ApiError(503, "no replica", type="ServiceUnavailableError"), "5xx"),
    (None, web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2), "4xx"),
    (None, asyncio.CancelledError(), "client_gone"),
    (None, RuntimeError("a bug"), "5xx"),
])
def test_answer_codes(response: web.StreamResponse | None, error: BaseException | None, code: str) -> None:
    assert answer_code(response, error) == code
    assert code in ANSWER_CODES


async def test_a_non_streamed_answer_counts_its_ttft_apart_from_streamed_ones(tmp_path: Path) -> None:
    """A non-streamed answer's first token reaches the client with its whole body: its TTFT is its end-to-end time,
    labelled stream="false" so a TTFT SLO reads streamed answers alone. A replica's 4xx counts no TTFT."""
    async with gateway(tmp_path, num_replicas=1) as gw:
        await drain_stream(await gw.client.chat.completions.create(**chat("a stream"), stream=True))
        await gw.client.chat.completions.create(**chat("not streamed"))
        too_long = chat("refused by the replica", max_tokens=200_000)  # past the sim's max_model_len: its 400
        status, headers, _ = await gw.post("/v1/chat/completions", json.dumps(too_long).encode())
        assert status == 400 and headers.get(REPLICA_HEADER)  # the replica's answer, not the gateway's
        exported = samples(await scrape(gw.url))
    assert value(exported, "kvgate_router_ttft_seconds_count", model="m", stream="true") == 1
    assert value(exported, "kvgate_router_ttft_seconds_count", model="m", stream="false") == 1
    assert value(exported, "kvgate_router_ttft_seconds_count", model="cold", stream="true") == 0


def test_a_reload_adds_and_drops_models_series_and_sets_their_slo(tmp_path: Path) -> None:
    write_registry(tmp_path, ["http://127.0.0.1:1"], spec="slo: {ttft_ms: 800}")
    metrics = RouterMetrics()
    metrics.note_registry(load_registry(tmp_path))
    metrics.ttft_seconds.labels("m", "true").observe(0.2)
    before = samples(metrics.render()[0].decode())
    assert value(before, "kvgate_router_slo_ttft_seconds", model="m") == 0.8
    assert value(before, "kvgate_router_slo_ttft_seconds", model="cold") is None  # no SLO declared
    assert value(before, "kvgate_router_tokens_total", model="m", adapter="sql", kind="cached") == 0

    registry = (tmp_path / "registry.yaml").read_text()
    without_cold = registry.split("---\napiVersion: kvgate/v1\nkind: Model\nmetadata: {name: cold}")[0]
    (tmp_path / "registry.yaml").write_text(without_cold.replace("slo: {ttft_ms: 800}", "") + "---\n"
                                            + registry.split("---\n")[-1])
    metrics.note_registry(load_registry(tmp_path))
    after = samples(metrics.render()[0].decode())
    assert not [key for key in after if dict(key[1]).get("model") == "cold"]
    assert value(after, "kvgate_router_slo_ttft_seconds", model="m") is None  # its SLO was removed
    assert value(after, "kvgate_router_ttft_seconds_count", model="m", stream="true") == 1  # a model that stays
    assert value(after, "kvgate_router_answers_total", model="_unknown", code="4xx") == 0  # kept, never reset
