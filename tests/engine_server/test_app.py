"""The replica's HTTP API over a real engine (builtin:tiny-llama) and real sockets (aiohttp TestServer)."""

from __future__ import annotations

import asyncio
import re

from aiohttp.test_utils import TestClient

from kvgate.engine.async_llm import AsyncLLM, EngineDead
from kvgate.engine.server.context import CONTEXT
from tests.engine_server.server_helpers import (MODEL, FakeLoRA, WithoutLoRA, make_settings, open_adapters,
                                                sse_events, start_client)
from tests.eventually import eventually

GREEDY = {"temperature": 0, "ignore_eos": True}


def long_prompt(tag: str) -> str:
    return f"{tag}: " + "the cat sat on the mat and looked at the hat. " * 8


# ------------------------------------------------------------------------------------ completions


async def test_a_completion_answers_a_text_completion_with_usage(client: TestClient) -> None:
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, **GREEDY})
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert body["created"] == 1_700_000_000
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_a_completion_without_max_tokens_gets_16_capped_by_the_room_left(client: TestClient) -> None:
    completion = await (await client.post("/v1/completions", json={
        "model": MODEL, "prompt": [5] * 10, **GREEDY})).json()
    assert completion["usage"]["completion_tokens"] == 16
    near_the_end = await (await client.post("/v1/completions", json={
        "model": MODEL, "prompt": [5] * 2040, **GREEDY})).json()
    assert near_the_end["usage"]["completion_tokens"] == 8  # max_model_len 2048 - 2040


async def test_a_prompt_of_token_ids_gives_the_same_text_as_its_string(client: TestClient, engine: AsyncLLM) -> None:
    ids = engine.core.tokenizer.encode("a token prompt", add_special_tokens=True)
    texts = []
    for prompt in ("a token prompt", ids):
        response = await client.post("/v1/completions",
                                     json={"model": MODEL, "prompt": prompt, "max_tokens": 6, **GREEDY})
        texts.append((await response.json())["choices"][0]["text"])
    assert texts[0] == texts[1]


async def test_a_streamed_completion_is_the_same_text_in_chunks_ending_with_done(client: TestClient) -> None:
    request = {"model": MODEL, "prompt": "stream me", "max_tokens": 12, **GREEDY}
    whole = await (await client.post("/v1/completions", json=request)).json()
    response = await client.post("/v1/completions", json={**request, "stream": True})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_include_usage_adds_a_final_chunk_with_usage_and_no_choices(client: TestClient) -> None:
    response = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "usage please", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}, **GREEDY})
    *chunks, usage_chunk, done = sse_events(await response.text())
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)  # as OpenAI: every chunk says usage: null
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4


async def test_completion_logprobs_in_the_legacy_format(client: TestClient) -> None:
    response = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "hello", "max_tokens": 4, "logprobs": 2, **GREEDY})
    logprobs = (await response.json())["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    # Greedy: the chosen token is the most likely one, so it leads its top_logprobs dict.
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[token] == lp and max(top.values()) == lp and 1 <= len(top) <= 3
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


# ------------------------------------------------------------------------------------------- chat


async def test_a_chat_completion_answers_an_assistant_message(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **GREEDY})
    body = await response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 6


async def test_a_streamed_chat_opens_with_the_role_and_ends_with_the_finish_reason(client: TestClient) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "stream"}], "max_tokens": 10, **GREEDY}
    whole = await (await client.post("/v1/chat/completions", json=request)).json()
    response = await client.post("/v1/chat/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}})
    *chunks, usage_chunk, done = sse_events(await response.text())
    assert done == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in [*chunks, usage_chunk])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = usage_chunk["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"], 10)


async def test_chat_logprobs_list_each_token_with_bytes_and_alternatives(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, **GREEDY})
    content = (await response.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]


async def test_a_repeated_prompt_reports_cached_tokens(client: TestClient) -> None:
    request = {"model": MODEL, "prompt": long_prompt("cache"), "max_tokens": 2, **GREEDY}
    first = await (await client.post("/v1/completions", json=request)).json()
    second = await (await client.post("/v1/completions", json=request)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert prompt_tokens - 16 < second["usage"]["prompt_tokens_details"]["cached_tokens"] <= prompt_tokens


# ------------------------------------------------------------------------------------------ errors


async def test_errors_are_openai_error_objects_with_their_status(engine: AsyncLLM) -> None:
    client = await start_client(engine, make_settings(max_body_bytes=4096))
    try:
        cases = [
            ("/v1/completions", b"{oops", 400, "invalid_json"),
            ("/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', 404, "model_not_found"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "invalid_value"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 129}', 400, "invalid_value"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}', 400, "invalid_value"),
            ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
             b'"tools": [{"type": "function", "function": {"name": "f"}}]}', 400, "invalid_value"),  # no tool template
            ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
             b'"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
             b'{"type": "string", "format": "no-such-format"}}}}', 400, "invalid_value"),
            ("/v1/completions", b'{"model": "tiny", "prompt": [1, 99999]}', 400, "invalid_value"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 4000}', 400,
             "context_length_exceeded"),
            ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "invalid_type"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}', 413, "body_too_large"),
            ("/v1/completions", b"[" * 2000 + b"]" * 2000, 400, "invalid_json"),  # past the parser's recursion limit
            ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc00"}]}',
             400, "invalid_json"),  # a lone surrogate: no tokenizer can encode it
            ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
             400, "invalid_json"),  # the same surrogate as UTF-8 bytes: not UTF-8
            ("/v1/completions", '{"model": "tiny", "prompt": "x"}'.encode("utf-16"), 400, "invalid_json"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "user": NaN}', 400, "invalid_json"),  # not JSON
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', 400, "invalid_json"),  # inf
        ]
        for path, body, status, code in cases:
            response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            error = (await response.json())["error"]
            assert (response.status, error["code"]) == (status, code), (body[:60], error)
            assert set(error) == {"message", "type", "param", "code"}
    finally:
        await client.close()


async def test_unknown_routes_and_methods_answer_openai_errors(client: TestClient) -> None:
    missing = await client.get("/v1/nothing")
    assert missing.status == 404 and (await missing.json())["error"]["type"] == "NotFoundError"
    wrong_method = await client.get("/v1/completions")
    assert wrong_method.status == 405 and "error" in await wrong_method.json()


async def test_the_context_error_states_both_numbers(client: TestClient) -> None:
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 48, "max_tokens": 2001})
    message = (await response.json())["error"]["message"]
    assert "maximum context length is 2048 tokens" in message and "2049 tokens (48 in the prompt, 2001" in message


# ------------------------------------------------------------------------------- models, health, metrics


async def test_models_lists_the_served_model(client: TestClient) -> None:
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert (model["id"], model["object"], model["owned_by"], model["parent"]) == (MODEL, "model", "kvgate", None)
    assert model["max_model_len"] == 2048


async def test_health_is_ok_once_warm(client: TestClient) -> None:
    response = await client.get("/health")
    assert response.status == 200 and (await response.json()) == {"status": "ok"}


async def test_metrics_expose_engine_state_and_latencies_from_the_injected_clock(client: TestClient) -> None:
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "metrics", "max_tokens": 3, **GREEDY})
    text = await (await client.get("/metrics")).text()
    value = {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}
    assert value["kvgate_engine_kv_blocks_free"] == value["kvgate_engine_kv_blocks_total"] == 512
    assert value["kvgate_engine_requests_running"] == 0 and value["kvgate_engine_draining"] == 0
    # The step clock moves 1 s per reading: arrival 0, tokens at 1, 2, 3 -> TTFT 1 s, TPOT (3-1)/2 = 1 s.
    assert value["kvgate_engine_time_to_first_token_seconds_sum"] == 1.0
    assert value["kvgate_engine_time_per_output_token_seconds_sum"] == 1.0
    assert value['kvgate_engine_requests_finished_total{finish_reason="length"}'] == 1
    for name in ("prefix_hit_tokens_total", "prefix_queried_tokens_total", "preemptions_total", "prefix_waits_total",
                 "generated_tokens_total", "requests_aborted_total", "requests_waiting", "adapter_loads_total",
                 "adapter_evictions_total", "adapters_loaded"):
        assert f"kvgate_engine_{name}" in value
    assert not [name for name in value if "_created" in name]  # no second series per counter (kvgate.exposition)


# ------------------------------------------------------------------------------- disconnect, drain


async def test_a_client_leaving_a_stream_aborts_the_request_and_frees_its_blocks(
        client: TestClient, engine: AsyncLLM) -> None:
    aborted_before = engine.stats.num_requests_aborted_total
    response = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "leave", "max_tokens": 1500, "stream": True, **GREEDY})
    for _ in range(3):
        await response.content.readline()
    assert engine.stats.num_running == 1
    response.close()  # drops the connection mid-stream
    await eventually(lambda: engine.stats.num_running == 0)
    stats = engine.stats
    assert stats.num_requests_aborted_total == aborted_before + 1
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


async def test_a_client_leaving_a_plain_request_aborts_it_too(client: TestClient, engine: AsyncLLM) -> None:
    aborted_before = engine.stats.num_requests_aborted_total
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "leave quietly", "max_tokens": 1500, **GREEDY}))
    await eventually(lambda: engine.stats.num_running == 1)
    request.cancel()  # the client closes its connection while waiting for the answer
    await eventually(lambda: engine.stats.num_running == 0)
    assert engine.stats.num_requests_aborted_total == aborted_before + 1


async def test_draining_refuses_new_requests_but_finishes_the_ones_in_flight(client: TestClient) -> None:
    lifecycle = client.app[CONTEXT].lifecycle
    stream = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "finish me", "max_tokens": 300, "stream": True, **GREEDY})
    first_line = await stream.content.readline()
    lifecycle.begin_drain()
    refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "late"})
    assert refused.status == 503 and refused.headers["Retry-After"] == "5"
    assert (await refused.json())["error"]["code"] == "draining"
    assert (await client.get("/health")).status == 503
    assert (await client.get("/metrics")).status == 200
    events = sse_events((first_line + await stream.read()).decode())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert await lifecycle.wait_idle(5.0)


async def test_a_drain_that_times_out_aborts_what_is_left(client: TestClient, engine: AsyncLLM) -> None:
    lifecycle = client.app[CONTEXT].lifecycle
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "too slow", "max_tokens": 1900, **GREEDY}))
    await eventually(lambda: engine.stats.num_running == 1)
    lifecycle.begin_drain()
    assert not await lifecycle.wait_idle(0.05)
    assert await lifecycle.cancel_in_flight() == 1
    await eventually(lambda: engine.stats.num_running == 0)
    request.cancel()


# ----------------------------------------------------------------------------------------- LoRA


async def test_adapter_endpoints_without_multi_lora_answer_501(engine: AsyncLLM) -> None:
    client = await start_client(WithoutLoRA(engine), make_settings())
    try:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert response.status == 501 and "no multi-LoRA support" in (await response.json())["error"]["message"]
        assert len((await (await client.get("/v1/models")).json())["data"]) == 1
    finally:
        await client.close()


async def test_loaded_adapters_are_listed_as_models_of_the_base_and_unloaded_by_name(engine: AsyncLLM) -> None:
    fake = FakeLoRA(engine)
    client = await start_client(fake, make_settings(adapter_access=open_adapters("/a")))
    try:
        loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/a/sql"})
        assert loaded.status == 200 and fake.sources == {"sql": "/a/sql"}
        models = (await (await client.get("/v1/models")).json())["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("sql", MODEL)]
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status == 200
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert missing.status == 404 and (await missing.json())["error"]["param"] == "lora_name"
        unnamed = await client.post("/v1/load_lora_adapter", json={"lora_path": "/a"})
        assert unnamed.status == 400 and (await unnamed.json())["error"]["param"] == "lora_name"
    finally:
        await client.close()


class DeadEngine(WithoutLoRA):
    """An engine whose worker died (a device error): every request fails with EngineDead."""

    is_alive = False

    async def generate(self, *args, **kwargs):
        raise EngineDead("the engine stopped: CUDA error")
        yield  # an async generator, like AsyncLLM.generate


async def test_a_dead_engine_answers_503_and_fails_health(engine: AsyncLLM) -> None:
    client = await start_client(DeadEngine(engine), make_settings(warmup=False))
    try:
        for stream in (False, True):
            response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
            error = (await response.json())["error"]
            assert (response.status, error["code"]) == (503, "engine_unavailable") and "CUDA error" in error["message"]
        assert (await client.get("/health")).status == 503
    finally:
        await client.close()
