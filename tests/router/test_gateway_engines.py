"""The gateway in front of two real `kvgate engine` processes on builtin:tiny-llama.

The engines are registry static replicas with backend `kvgate` and a `grpc_target`, so their load
comes from the engine's WatchState stream; they start once for the module (a few seconds each) and
every test builds a fresh in-process gateway over them. Health checks run every 60 s, as in
test_gateway.py, so nothing but requests and the state stream moves during a test.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from kvgate.router.membership import static_replica_id
from kvgate.router.proxy import REPLICA_HEADER
from kvgate.router.replicas import ReplicaTracker
from tests.engine.peft_files import write_peft_dir
from tests.eventually import eventually
from tests.gateway_harness import running_gateway
from tests.router.sim_gateway import static_id
from tests.services import free_loopback_port
from tests.engine_server.test_process import SERVED, Replica, start_replica, stop

ADAPTER = "sql"  # a LoRA adapter every engine registers: its KV blocks hash under its name
# ~2,100 characters: dozens of 16-token KV blocks, so a repeat has a prefix the engine can serve from cache.
LONG_PROMPT = "You are a careful assistant for the kvgate project, answering in short sentences. " * 26
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Engine:
    replica: Replica
    grpc_target: str

    @property
    def url(self) -> str:
        return self.replica.url

    def metric(self, name: str) -> float:
        return self.replica.metric(name)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    work = tmp_path_factory.mktemp("engines")
    grpc_ports = [free_loopback_port(), free_loopback_port()]
    adapter = write_peft_dir(work / "sql-lora")
    with ThreadPoolExecutor(2) as pool:  # both start at once: startup is mostly waiting on imports
        replicas = list(pool.map(lambda port: start_replica(work, "--grpc-port", str(port), "--kv-cache-bytes",
                                                            "4MiB", "--adapter", f"{ADAPTER}={adapter}"),
                                 grpc_ports))
    try:
        yield [Engine(r, f"127.0.0.1:{p}") for r, p in zip(replicas, grpc_ports)]
    finally:
        for replica in replicas:
            stop(replica)


@dataclass
class Gateway:
    url: str
    client: openai.AsyncOpenAI
    tracker: ReplicaTracker
    engines: list[Engine]  # the static replicas it fronts, in the registry's order

    def id_of(self, engine: Engine) -> str:
        """The engine's public id in this gateway (x-kvgate-replica): its place in this gateway's registry."""
        return static_id([e.url for e in self.engines], engine.url, SERVED)

    def engine_at(self, replica_id: str) -> Engine:
        return next(e for e in self.engines if self.id_of(e) == replica_id)

    async def admin_stats(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/admin/stats") as r:
            return await r.json()


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, engines: list[Engine], extra_static: str = "") -> AsyncIterator[Gateway]:
    static = ", ".join([*(f"{{url: '{e.url}', backend: kvgate, grpc_target: '{e.grpc_target}'}}" for e in engines),
                        *([extra_static] if extra_static else [])])
    (tmp_path / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {SERVED}}}
spec:
  source: builtin:tiny-llama
  routing: {{prefix_chunk_chars: 64, static_replicas: [{static}]}}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: {ADAPTER}}}
spec: {{base_model: {SERVED}, source: /adapters/{ADAPTER}, rank: 4}}
""")
    async with running_gateway(tmp_path) as (url, tracker):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
        try:
            urls = {e.url for e in engines}
            await eventually(lambda: all(r.kv_blocks_total > 0 for r in tracker.view(SERVED).replicas
                                         if r.url in urls))  # the engines' streams are up
            yield Gateway(url, client, tracker, engines)
        finally:
            await client.close()


async def on_kv_blocks(gw: Gateway) -> None:
    """Until the gateway routes the model on its engines' KV blocks (tokenizer fetched, streams synced)."""
    await eventually(lambda: gw.tracker.kv_chain(SERVED) is not None)


async def settled(gw: Gateway, replica_id: str) -> None:
    """Until the replica's KV events have caught up with every request this gateway sent it: the gateway
    drops a request's predicted blocks at the second state report after it ended, and that report holds
    what the engine kept of it."""
    await eventually(lambda: not gw.tracker.blocks.get(replica_id).predicted,
                     f"the state reports of {replica_id} after its requests")


async def test_the_openai_sdk_streams_and_not_through_the_gateway(tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        reply = await gw.client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **GREEDY)
        assert reply.object == "chat.completion" and reply.usage.completion_tokens == 4
        stream = await gw.client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 5
        assert chunks[-2].choices[0].finish_reason == "length"
        text = await gw.client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, stream=True, **GREEDY)
        assert sum(1 for c in [c async for c in text] if c.choices and c.choices[0].text is not None) >= 3


async def test_structured_output_and_n_samples_pass_through_the_gateway(tmp_path: Path, engines: list[Engine]) -> None:
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    async with gateway(tmp_path, engines) as gw:
        reply = await gw.client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], n=3, seed=5, temperature=1.0, max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert all(json.loads(c.message.content)["ok"] in (True, False) for c in reply.choices)
        with pytest.raises(openai.BadRequestError, match="no-such-format"):  # the engine's 400, passed on
            await gw.client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": "Hi"}], response_format={
                    "type": "json_schema", "json_schema": {"name": "s", "schema": {"format": "no-such-format",
                                                                                   "type": "string"}}})


async def test_a_repeated_long_prompt_stays_on_one_engine_and_hits_its_cache(tmp_path: Path,
                                                                          engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        served_by, cached = set(), []
        for _ in range(4):
            raw = await gw.client.completions.with_raw_response.create(
                model=SERVED, prompt=LONG_PROMPT, max_tokens=2, **GREEDY)
            served_by.add(raw.headers[REPLICA_HEADER])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        assert len(served_by) == 1
        assert all(c > 0 for c in cached[1:]), cached
        # The gateway learnt tiny-llama's characters per token from usage.prompt_tokens: 4 answers
        # move the estimate from 4.0 by 1 - 0.9^4 of the way to the real ratio.
        ratio = len(LONG_PROMPT) / raw.parse().usage.prompt_tokens
        assert ratio < 3.5  # tiny-llama's small vocabulary: far fewer characters per token than 4
        assert gw.tracker.chars_per_token_of(SERVED) == pytest.approx(ratio + (4.0 - ratio) * 0.9 ** 4, rel=0.02)


async def test_a_client_that_drops_a_stream_aborts_it_in_the_engine(tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        aborted_before = {e.url: e.metric("kvgate_engine_requests_aborted_total") for e in engines}
        body = {"model": SERVED, "prompt": "Count slowly", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            response = await s.post(gw.url + "/v1/completions", json=body)
            assert response.status == 200
            await response.content.readline()
            engine = gw.engine_at(response.headers[REPLICA_HEADER])
            response.close()  # the client goes away after the first event
        aborted = "kvgate_engine_requests_aborted_total"
        await eventually(lambda: engine.metric(aborted) > aborted_before[engine.url])
        await eventually(lambda: engine.metric("kvgate_engine_kv_blocks_free")
                         == engine.metric("kvgate_engine_kv_blocks_total"))


async def test_engine_load_reaches_admin_stats_over_the_grpc_stream(tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        body = {"model": SERVED, "prompt": "Count slowly", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=body) as response:
            await response.content.readline()
            busy = response.headers[REPLICA_HEADER]

            async def replicas_once_busy_runs() -> dict | None:
                replicas = {r["replica_id"]: r for r in (await gw.admin_stats())["models"][SERVED]["replicas"]}
                return replicas if replicas[busy]["num_running"] == 1 else None
            replicas = await eventually(replicas_once_busy_runs, "the busy engine's stream reports its request")
            assert replicas[busy]["num_running"] + replicas[busy]["num_waiting"] == 1
            assert replicas[busy]["kv_blocks_free"] < replicas[busy]["kv_blocks_total"]
            idle = next(r for rid, r in replicas.items() if rid != busy)
            assert idle["num_running"] == 0 and idle["kv_blocks_total"] > 0
            # Routed on the engines' KV block events: the index is the engine's own pool, in blocks.
            assert replicas[busy]["prefix_source"] == "kv_events"
            assert replicas[busy]["prefix_capacity_chunks"] == replicas[busy]["kv_blocks_total"]
            response.close()


# --------------------------------------------------------------------- routing on KV block events

CHAT_BODIES = [
    {"messages": [{"role": "system", "content": LONG_PROMPT}, {"role": "user", "content": "Name one colour."}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]},
                  {"role": "assistant", "content": None}, {"role": "user", "content": "and more"}]},
]
COMPLETION_BODIES = [{"prompt": LONG_PROMPT}, {"prompt": ["A batch of one"]}, {"prompt": [5, 6, 7, 8, 9]}]


async def test_the_gateway_tokenizes_every_prompt_shape_as_the_engine_does(tmp_path: Path,
                                                                           engines: list[Engine]) -> None:
    """The tokenizer comes from the engines (GetTokenizer); the gateway's token count for each body
    equals the engine's own usage.prompt_tokens, so their block hashes are the same chain."""
    from kvgate.router.prompt_tokens import prompt_token_ids

    async with gateway(tmp_path, engines) as gw:
        await on_kv_blocks(gw)
        tokenizer = gw.tracker.kv_chain(SERVED).tokenizer
        async with aiohttp.ClientSession() as s:
            for path, bodies in (("/v1/chat/completions", CHAT_BODIES), ("/v1/completions", COMPLETION_BODIES)):
                for body in bodies:
                    body = {**body, "model": SERVED, "max_tokens": 1}
                    async with s.post(gw.url + path, json=body) as response:
                        assert response.status == 200, await response.text()
                        usage = (await response.json())["usage"]
                    assert len(prompt_token_ids(body, tokenizer)) == usage["prompt_tokens"], body


@pytest.mark.parametrize("model", [SERVED, ADAPTER])
async def test_a_prefix_hit_is_predicted_to_the_token_from_the_engines_events(tmp_path: Path, engines: list[Engine],
                                                                              model: str) -> None:
    """A conversation's turns go to the engine whose events say it holds the earlier turn, and what the
    gateway predicted it holds is what the engine then served from cache (usage.cached_tokens): for the
    base model, and for a LoRA adapter, whose name is in every block hash on both sides."""
    async with gateway(tmp_path, engines) as gw:
        await on_kv_blocks(gw)
        messages = [{"role": "system", "content": LONG_PROMPT + f" Turn-test {model}."},
                    {"role": "user", "content": "Hi"}]
        served_by = set()
        async with aiohttp.ClientSession() as s:
            for turn in range(3):
                body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
                async with s.post(gw.url + "/v1/chat/completions", json=body) as response:
                    reply = await response.json()
                    served_by.add(response.headers[REPLICA_HEADER])
                messages = [*messages, reply["choices"][0]["message"], {"role": "user", "content": f"And {turn}?"}]
                await settled(gw, response.headers[REPLICA_HEADER])  # the next turn is predicted from its events
        assert len(served_by) == 1
        index_id = served_by.pop()
        index = gw.tracker.blocks.get(index_id)
        stats = index.stats()
        assert stats.realised_cached_tokens_total > 0
        assert stats.predicted_cached_tokens_total == stats.realised_cached_tokens_total
        assert stats.num_corrections_total == 0
        # The text index was kept too, for a fall back to text: it holds the conversation's opening.
        text_index = gw.tracker.prefixes.get(index_id)
        assert text_index is not None and len(text_index) > 0


async def test_two_gateways_that_share_nothing_agree_through_the_engines_events(tmp_path: Path,
                                                                                engines: list[Engine]) -> None:
    """Gateway A fronts only engine 1 and sends it six long prompts. Gateway B fronts both engines and has
    never seen them: it still sends each follow-up to engine 1, as a prefix hit, because engine 1's
    KV block events told it what engine 1 holds. (Guessing from its own history, B would have no
    prefix to go on and pick by rendezvous: all six right by chance is 1 in 64.)"""
    prompts = [f"Conversation {i}: " + LONG_PROMPT for i in range(6)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with gateway(tmp_path / "a", engines[1:]) as gw_a, gateway(tmp_path / "b", engines) as gw_b:
        await on_kv_blocks(gw_a)
        await on_kv_blocks(gw_b)
        async with aiohttp.ClientSession() as s:
            for prompt in prompts:
                body = {"model": SERVED, "prompt": prompt, "max_tokens": 1}
                async with s.post(gw_a.url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    assert response.headers[REPLICA_HEADER] == gw_a.id_of(engines[1])  # its first: -static-0
            await settled(gw_a, gw_a.id_of(engines[1]))
            await eventually(lambda: gw_a.tracker.blocks.get(gw_a.id_of(engines[1])).cached
                             <= gw_b.tracker.blocks.get(gw_b.id_of(engines[1])).cached,
                             "B holds every block engine 1 reported to A")  # one stream's reports, to both
            for prompt in prompts:
                body = {"model": SERVED, "prompt": prompt + " And then?", "max_tokens": 1}
                async with s.post(gw_b.url + "/v1/completions", json=body) as response:
                    assert response.headers[REPLICA_HEADER] == gw_b.id_of(engines[1])  # its second: -static-1
                    assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        reasons = [d["reason"] for d in (await gw_b.admin_stats())["recent_decisions"]]
        assert reasons == ["prefix_hit"] * len(prompts)


async def test_a_fleet_with_a_foreign_server_routes_on_text_and_a_dead_stream_counts_as_holding_nothing(
        tmp_path: Path, engines: list[Engine]) -> None:
    """KV blocks only where every routable replica can report them: a vLLM server among the engines sends
    the model back to the text index. An engine whose stream is down (here: nothing listens at its gRPC
    port, and health checks are 60 s apart, so it stays routable) does not: it counts as holding nothing."""
    dead = f"127.0.0.1:{free_loopback_port()}"
    (tmp_path / "dead").mkdir()
    (tmp_path / "foreign").mkdir()
    async with gateway(tmp_path / "dead", engines,
                       f"{{url: 'http://{dead}', backend: kvgate, grpc_target: '{dead}'}}") as gw:
        await on_kv_blocks(gw)
        assert gw.tracker.blocks.match_length(static_replica_id(SERVED, len(engines)), (1, 2, 3)) == 0
        assert (await gw.admin_stats())["models"][SERVED]["routes_on"] == "kv_blocks"
    from loadtests.sim_replica import SimReplicaConfig, start_sim_replica  # a vLLM stand-in: /health, /metrics

    vllm = await start_sim_replica(SimReplicaConfig(model=SERVED))
    try:
        await _on_text_with(tmp_path / "foreign", engines, vllm.url)
    finally:
        await vllm.close()


async def _on_text_with(tmp_path: Path, engines: list[Engine], foreign: str) -> None:
    async with gateway(tmp_path, engines, f"{{url: '{foreign}', backend: vllm}}") as gw:
        await eventually(lambda: all(gw.tracker.blocks.is_synced(gw.id_of(e)) for e in engines))
        await eventually(lambda: gw.tracker.tokenizers.get(SERVED), "an engine sent its tokenizer")
        # The tokenizer is there and the engines' streams are synced, yet the model stays on text:
        assert gw.tracker.num_ready(SERVED) == 3  # the vLLM stand-in is routable: it is why this is on text
        assert gw.tracker.kv_chain(SERVED) is None
        assert (await gw.admin_stats())["models"][SERVED]["routes_on"] == "text"


async def test_token_ids_the_block_hash_cannot_take_are_the_engines_400_not_a_gateway_500(
        tmp_path: Path, engines: list[Engine]) -> None:
    async with gateway(tmp_path, engines) as gw:
        await on_kv_blocks(gw)
        async with aiohttp.ClientSession() as s:
            for prompt in ([2**32] * 20, [-1] * 20, [[1, 2], [3]]):  # 20: a full KV block gets hashed
                body = {"model": SERVED, "prompt": prompt, "max_tokens": 1}
                async with s.post(gw.url + "/v1/completions", json=body) as response:
                    assert response.status == 400, (prompt, await response.text())
                    assert (await response.json())["error"]["message"]
            # `messages` on /v1/completions is no field of that endpoint: the engine reads the prompt, and so does
            # the gateway, whatever `messages` holds (it was once a 500 here, then a 400 the engine would not give).
            for messages in (5, "abc", [1], [{"role": "user", "content": "other text"}]):
                body = {"model": SERVED, "prompt": "Hi", "messages": messages, "max_tokens": 1}
                async with s.post(gw.url + "/v1/completions", json=body) as response:
                    assert response.status == 200, (messages, await response.text())
                    assert (await response.json())["usage"]["prompt_tokens"] == 3  # "Hi", not the messages


async def test_a_tokenizer_that_counts_differently_from_the_engine_is_dropped_and_fetched_again(
        tmp_path: Path, engines: list[Engine]) -> None:
    """A stale tokenizer (here SmolLM2's in place of tiny-llama's, as after a change of weights under a
    gateway): the first response's usage.prompt_tokens disagrees with the gateway's count, the model goes
    back to text and the engine's tokenizer is fetched again."""
    from kvgate.tokenizer import Tokenizer
    from kvgate.router.prompt_tokens import PromptTokenizer, prompt_token_ids
    from kvgate.router.engine_tokenizers import KvChain
    from tests.engine.builtin_cache import smollm2_dir

    async with gateway(tmp_path, engines) as gw:
        await on_kv_blocks(gw)
        right = gw.tracker.kv_chain(SERVED)
        gw.tracker.tokenizers.put(SERVED, KvChain(PromptTokenizer(Tokenizer.from_dir(smollm2_dir())), 16))
        body = {"model": SERVED, "messages": [{"role": "user", "content": LONG_PROMPT[:400]}],
                "max_tokens": 1}
        assert len(prompt_token_ids(body, gw.tracker.kv_chain(SERVED).tokenizer)) != len(
            prompt_token_ids(body, right.tokenizer))
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=body) as response:
            engine_count = (await response.json())["usage"]["prompt_tokens"]
        await eventually(lambda: gw.tracker.kv_chain(SERVED) is not None
                         and len(prompt_token_ids(body, gw.tracker.kv_chain(SERVED).tokenizer)) == engine_count)
