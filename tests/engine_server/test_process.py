"""A real `kvgate engine` process on builtin:tiny-llama, driven by the official openai SDK, unmodified."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from kvgate.engine.builtin import CACHE_DIR_ENV
from kvgate.engine.server.adapter_access import ADMIN_TOKEN_ENV
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from tests.services import free_loopback_port, kvgate_command
from tests.engine.builtin_cache import shared_cache_dir, tiny_llama_dir
from tests.engine.peft_files import write_peft_dir
from tests.eventually import eventually, eventually_sync
from tests.malformed_http import MALFORMED, SECRET, send_malformed

MODEL = "builtin:tiny-llama"
SERVED = "tiny-llama"  # a built-in is served under its registry name
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Replica:
    process: subprocess.Popen
    url: str
    log_path: Path

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", **kwargs)

    def async_openai(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", **kwargs)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def start_replica(tmp_path: Path, *extra: str, env: dict[str, str] | None = None, model: str = MODEL) -> Replica:
    """`kvgate engine` on `model` (tiny-llama) with `extra` arguments, in this environment without
    $KVGATE_ENGINE_ADMIN_TOKEN and with `env` added; returns once /health answers 200."""
    tiny_llama_dir()  # built once, before the server looks for it
    port = free_loopback_port()
    log_path = tmp_path / f"engine-{port}.log"
    command = [*kvgate_command(), "engine", "--model", model, "--port", str(port), "--kv-cache-bytes", "8MiB",
               "--cache-dir", str(shared_cache_dir()), *extra]
    env = {**{k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}, CACHE_DIR_ENV: str(shared_cache_dir()),
           **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    replica = Replica(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"kvgate engine did not become healthy:\n{log_path.read_text()}", pytrace=False)
        try:
            if replica.get("/health")[0] == 200:
                return replica
        except OSError:
            pass
        time.sleep(0.05)


def stop(replica: Replica) -> None:
    if replica.process.poll() is None:
        replica.process.kill()
        replica.process.wait()


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[Replica]:
    work = tmp_path_factory.mktemp("replica")
    replica = start_replica(work, "--adapter", f"sql={write_peft_dir(work / 'sql-lora')}")
    yield replica
    stop(replica)


def test_the_process_logs_a_ready_line(replica: Replica) -> None:
    assert re.search(rf"kvgate engine ready: model {SERVED} on {replica.url}", replica.log_path.read_text())


def test_the_process_logs_its_start_up_phases(replica: Replica) -> None:
    """One line that says where start-up went, adding up to the time since the process started."""
    line = re.search(r"start-up: ([0-9.]+) s: (.*)", replica.log_path.read_text())
    assert line, replica.log_path.read_text()[-2000:]
    phases = dict(re.findall(r"([a-z_]+) ([0-9.]+)", line[2]))
    assert set(phases) >= {"process", "source", "tokenizer", "build", "weights", "prepare", "kv_cache", "warm_up",
                           "other"}
    assert abs(sum(map(float, phases.values())) - float(line[1])) < 0.05
    assert re.search(r"weights [0-9.]+ \([0-9]+ MB, [0-9.]+ GB/s\)", line[2])


def test_sync_client_completion_and_chat(replica: Replica) -> None:
    client = replica.openai()
    completion = client.completions.create(model=SERVED, prompt="Hello", max_tokens=5, **GREEDY)
    assert completion.object == "text_completion" and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [SERVED, "sql"]


def test_the_model_answers_to_the_source_it_was_started_with_too(replica: Replica) -> None:
    client = replica.openai()
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, **GREEDY)  # builtin:tiny-llama
    assert completion.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [SERVED, "sql"]


def test_an_unknown_model_gets_a_404_that_says_what_is_served(replica: Replica) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        replica.openai(max_retries=0).completions.create(model="tiny", prompt="x")
    assert missing.value.body["message"] == f"The model 'tiny' does not exist; this server serves: {SERVED}, sql"


def test_an_adapter_given_at_start_is_served_under_its_name(replica: Replica) -> None:
    completion = replica.openai().completions.create(model="sql", prompt="Hello", max_tokens=3, **GREEDY)
    assert completion.model == "sql" and completion.usage.completion_tokens == 3


async def test_async_client_runs_concurrent_chats(replica: Replica) -> None:
    client = replica.async_openai()
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": f"question {i}"}],
                                       max_tokens=8, **GREEDY) for i in range(4)))
    assert all(r.usage.completion_tokens == 8 for r in replies)
    await client.close()


def test_streamed_chat_with_usage_matches_the_plain_answer(replica: Replica) -> None:
    client = replica.openai()
    request = {"model": SERVED, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 12, **GREEDY}
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_streamed_completion_with_usage(replica: Replica) -> None:
    client = replica.openai()
    chunks = list(client.completions.create(model=SERVED, prompt="Once", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].usage.total_tokens > 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_repeated_long_prompt_reports_cached_tokens(replica: Replica) -> None:
    client = replica.openai()
    prompt = "A long shared system prompt about caching. " * 10
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_bad_requests_raise_the_sdks_typed_errors(replica: Replica) -> None:
    client = replica.openai(max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n must be an integer from 1 to 128"):
        client.completions.create(model=SERVED, prompt="x", n=200)


def test_a_client_leaving_mid_stream_frees_its_blocks(replica: Replica) -> None:
    aborted_before = replica.metric("kvgate_engine_requests_aborted_total")
    client = replica.openai()
    stream = client.completions.create(model=SERVED, prompt="go on", max_tokens=1800, stream=True, **GREEDY)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    eventually_sync(lambda: replica.metric("kvgate_engine_requests_aborted_total") > aborted_before,
                    "the request aborted")
    assert replica.metric("kvgate_engine_requests_running") == 0
    assert replica.metric("kvgate_engine_kv_blocks_free") == replica.metric("kvgate_engine_kv_blocks_total")


async def test_fifty_malformed_requests_are_one_warning_per_kind_in_the_log_without_traceback_or_headers(
        replica: Replica) -> None:
    before = len(replica.log_path.read_text().splitlines())
    statuses = await send_malformed("127.0.0.1", int(replica.url.rsplit(":", 1)[1]), 50)
    assert all(status.endswith(b" 400 Bad Request") or status == b"" for status in statuses), statuses
    await asyncio.sleep(0.2)  # the last line written
    log = "\n".join(replica.log_path.read_text().splitlines()[before:])
    lines = [line for line in log.splitlines() if "aiohttp.server" in line]
    kinds = {line.partition("127.0.0.1: ")[2].split(",")[0] for line in lines}  # "LineTooLong", ...
    assert len(lines) == len(kinds) <= len(MALFORMED), log  # where there was an ERROR traceback per request
    assert all(" WARNING aiohttp.server: malformed HTTP request from 127.0.0.1: " in line for line in lines), log
    assert "Traceback" not in log and SECRET not in log


def replica_state(port: int) -> replica_pb2.ReplicaState:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return replica_pb2_grpc.ReplicaStub(channel).GetState(replica_pb2.GetStateRequest(), timeout=5)


async def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_zero(tmp_path: Path) -> None:
    grpc_port = free_loopback_port()
    replica = start_replica(tmp_path, "--grpc-port", str(grpc_port), "--replica-id", "drain-test")
    try:
        state = replica_state(grpc_port)
        assert (state.replica_id, state.model, state.draining) == ("drain-test", SERVED, False)
        client = replica.async_openai(max_retries=0)
        stream = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "a long answer"}], max_tokens=1500, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        chunks = [await anext(aiter(stream))]
        replica.process.send_signal(signal.SIGTERM)

        async def refusing() -> bool:
            return (await asyncio.to_thread(replica.get, "/health"))[0] == 503
        await eventually(refusing, "/health answers 503 once SIGTERM is in")
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model=SERVED, prompt="too late", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"]
        assert (await asyncio.to_thread(replica_state, grpc_port)).draining  # the router hears it too
        chunks += [chunk async for chunk in stream]
        assert chunks[-1].usage.completion_tokens == 1500  # the in-flight request was not cut short
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert await asyncio.to_thread(replica.process.wait, 30) == 0
        assert "kvgate engine stopped" in replica.log_path.read_text()
        await client.close()
    finally:
        stop(replica)


def test_bad_arguments_exit_2_and_an_unloadable_model_exits_1_without_tracebacks(tmp_path: Path) -> None:
    bad_args = subprocess.run([*kvgate_command(), "engine", "--model", MODEL, "--kv-cache-bytes", "lots"],
                              capture_output=True, text=True, timeout=60)
    assert bad_args.returncode == 2 and "--kv-cache-bytes" in bad_args.stderr
    missing = subprocess.run([*kvgate_command(), "engine", "--model", str(tmp_path / "nothing"), "--port", "0"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "cannot load model" in missing.stderr
    assert "Traceback" not in bad_args.stderr + missing.stderr


# ------------------------------------------------------------------------ the adapter endpoints (admin)

TOKEN = "engine-admin-s3cret"


def post(replica: Replica, path: str, body: dict[str, Any], token: str | None = None) -> tuple[int, str, Any]:
    """POST JSON; (status, body text, headers)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(replica.url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


def test_beyond_loopback_the_adapter_endpoints_take_the_token_from_the_environment_and_only_roots(
        tmp_path: Path) -> None:
    root, started = tmp_path / "root", write_peft_dir(tmp_path / "started" / "sql")
    chat = write_peft_dir(root / "chat")
    replica = start_replica(tmp_path, "--host", "0.0.0.0", "--adapter", f"sql={started}", "--adapter-root", str(root),
                            env={ADMIN_TOKEN_ENV: TOKEN})
    try:
        status, _, headers = post(replica, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(chat)})
        assert (status, headers["WWW-Authenticate"]) == (401, "Bearer")
        assert post(replica, "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 401
        assert post(replica, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(chat)}, TOKEN)[0] == 200
        status, text, _ = post(replica, "/v1/load_lora_adapter",
                               {"lora_name": "other", "lora_path": f"{root}/../started"}, TOKEN)
        assert status == 403 and json.loads(text)["error"]["code"] == "adapter_source_not_allowed"
        # An adapter the engine was started with may come back after an unload, though it is under no root.
        assert post(replica, "/v1/unload_lora_adapter", {"lora_name": "sql"}, TOKEN)[0] == 200
        assert post(replica, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(started)}, TOKEN)[0] == 200
        assert [m.id for m in replica.openai().models.list()] == [SERVED, "chat", "sql"]
        assert TOKEN not in Path(f"/proc/{replica.process.pid}/cmdline").read_text()  # nothing for `ps` to show
        log = replica.log_path.read_text()
        assert "adapter endpoints need the admin token" in log and TOKEN not in log
    finally:
        stop(replica)


def test_beyond_loopback_without_a_token_the_adapter_endpoints_are_off_unless_opened_with_a_warning(
        tmp_path: Path) -> None:
    chat = write_peft_dir(tmp_path / "root" / "chat")
    body = {"lora_name": "chat", "lora_path": str(chat)}
    closed = start_replica(tmp_path, "--host", "0.0.0.0", "--adapter-root", str(tmp_path / "root"))
    try:
        status, text, _ = post(closed, "/v1/load_lora_adapter", body)
        assert status == 403 and ADMIN_TOKEN_ENV in json.loads(text)["error"]["message"]
    finally:
        stop(closed)
    opened = start_replica(tmp_path, "--host", "0.0.0.0", "--adapter-root", str(tmp_path / "root"),
                           "--insecure-open-adapters")
    try:
        assert post(opened, "/v1/load_lora_adapter", body)[0] == 200
        assert re.search(r"WARNING .*adapter endpoints are OPEN without a token", opened.log_path.read_text())
    finally:
        stop(opened)
