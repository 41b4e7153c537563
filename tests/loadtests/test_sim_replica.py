"""The simulated replica: OpenAI shapes, prefix caching with LRU eviction, queueing, failure injection."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from loadtests.sim_replica import FailMode, FailureSpec, SimReplicaConfig, start_sim_replica
from loadtests.sim_replica_model import PrefixCache, Scheduler, SchedulerSpec, SimSequence, block_hashes
from kvgate.clock import FakeClock
from tests.eventually import eventually

FAST = SchedulerSpec(kv_capacity_tokens=32_768, prefill_tokens_per_s=1_000_000.0, decode_tokens_per_s=2_000.0)
LONG_A = "A" * 60 + "".join(f"alpha block {i:03d} " for i in range(40))  # 700 chars -> 175 tokens


def long_prompt(tag: str) -> str:
    """640 characters = 160 tokens = 10 full blocks, distinct per tag from the first block on."""
    return (tag * 64)[:64] + "x" * 576


@pytest.fixture
async def serve():
    servers = []

    async def start(clock=None, **kwargs):
        server = await start_sim_replica(SimReplicaConfig(**({"model": "sim", "scheduler": FAST} | kwargs)), clock=clock)
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.close()


async def post(session: aiohttp.ClientSession, url: str, prompt: str, **body) -> dict:
    async with session.post(f"{url}/v1/completions", json={"model": "sim", "prompt": prompt} | body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def stats(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/stats") as r:
        return await r.json()


def aborted_stats(url: str):
    """For `eventually`: the replica's /stats once it has aborted a request, else None."""
    async def read() -> dict | None:
        st = await stats(url)
        return st if st["num_aborted"] else None
    return read


# --- the pure model ---------------------------------------------------------------------------------


def test_cold_prefill_then_decode_costs_follow_the_rates():
    # 160-token prompt at 8,000 tok/s -> 20 ms to the first token; each further token 1/50 s = 20 ms.
    sched = Scheduler(SchedulerSpec(prefill_tokens_per_s=8_000.0, decode_tokens_per_s=50.0))
    sched.add(SimSequence(1, "m", 160, block_hashes(long_prompt("a"), "m"), max_tokens=2))
    first = sched.schedule()
    assert first.duration_s == pytest.approx(0.020) and first.prefill == ((1, 160),)
    assert [e.index for e in sched.complete(first)] == [0]
    second = sched.schedule()
    assert second.duration_s == pytest.approx(0.020) and second.decode == (1,)
    assert sched.complete(second)[0].finished


def test_adapter_name_seeds_the_hash_chain():
    assert block_hashes(long_prompt("a"), "base") != block_hashes(long_prompt("a"), "lora-1")
    assert len(block_hashes(long_prompt("a"), "base")) == 10


def two_requests_on_one_prompt(spec: SchedulerSpec) -> Scheduler:
    """A scheduler holding two requests on the same 160-token (10-block) prompt, one after the other."""
    sched = Scheduler(spec)
    hashes = block_hashes(long_prompt("a"), "m")
    for seq_id in (1, 2):
        sched.add(SimSequence(seq_id, "m", 160, hashes, max_tokens=1))
    return sched


def test_a_prompt_scheduled_in_the_same_step_hits_the_blocks_scheduled_ahead_of_it():
    # vLLM v1 caches a block's hash when it schedules the block's computation, so a second request on the
    # same 10-block prompt, scheduled in the same step, hits the 9 blocks it may (never the last token's).
    sched = two_requests_on_one_prompt(SchedulerSpec(prefill_tokens_per_s=8_000.0))
    plan = sched.schedule()
    assert plan.prefill == ((1, 160), (2, 16))
    assert (sched.num_cached_tokens(1), sched.num_cached_tokens(2)) == (0, 144)
    assert plan.duration_s == pytest.approx(176 / 8_000.0)


def test_a_request_behind_a_chunked_prefill_hits_what_it_scheduled():
    # 64-token steps: the first request's prompt takes three steps. The second, on the same prompt, gets
    # budget only in the third, once all of the first's blocks are scheduled, and hits them there.
    sched = two_requests_on_one_prompt(SchedulerSpec(prefill_tokens_per_s=8_000.0, max_prefill_tokens_per_step=64))
    plans = [sched.schedule()]
    for _ in range(2):
        sched.complete(plans[-1])
        plans.append(sched.schedule())
    assert [p.prefill for p in plans] == [((1, 64),), ((1, 64),), ((1, 32), (2, 16))]
    assert sched.num_cached_tokens(2) == 144


def test_eviction_trims_a_chain_from_its_tail():
    # vLLM v1 frees a finished request's blocks in reverse order, so the tail is evicted first and what
    # is left is still a prefix: a conversation squeezed by another loses its last blocks, not its first
    # one (which would take every block behind it out of reach).
    conversation, other = block_hashes(long_prompt("a"), "m"), block_hashes(long_prompt("b"), "m")
    cache = PrefixCache(capacity_blocks=14)
    cache.insert(conversation)
    assert cache.match(conversation) == 10  # a later turn's look-up touches the chain too
    cache.insert(other[:4])  # 4 more blocks: 14 in all
    cache.insert(other[:6])  # 2 over capacity: the conversation's last 2 go
    assert cache.peek(conversation) == 8
    assert cache.peek(other) == 6


# --- the OpenAI SDK -----------------------------------------------------------------------------------


async def test_async_openai_sdk_chat_streamed_and_not(serve):
    server = await serve(adapters=("sql-lora",))
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    reply = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    stream = await client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content[: len(text)] and len(text.split()) == 4
    assert chunks[-1].usage.completion_tokens == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim", "sql-lora"]
    await client.close()


async def test_sync_openai_sdk_completions_streamed_and_not(serve):
    server = await serve()

    def call() -> tuple[str, str]:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        whole = client.completions.create(model="sim", prompt="Once upon", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        parts = client.completions.create(model="sim", prompt="Once upon", max_tokens=3, stream=True,
                                          extra_body={"min_tokens": 1})
        return whole.choices[0].text, "".join(p.choices[0].text for p in parts if p.choices)

    whole, streamed = await asyncio.to_thread(call)
    assert whole == streamed and len(whole.split()) == 3


async def test_unknown_model_is_a_404_openai_error(serve):
    server = await serve()
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi")
    await client.close()


async def test_a_request_past_the_context_length_is_a_400_openai_error(serve):
    """As vLLM refuses a prompt plus max_tokens past max_model_len; an unbounded max_tokens held a batch slot
    for good."""
    server = await serve()
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 131072 tokens"):
        await client.completions.create(model="sim", prompt="hi", max_tokens=10**30)
    assert (await client.completions.create(model="sim", prompt="hi", max_tokens=2)).usage.completion_tokens == 2
    await client.close()


# --- prefix cache ---------------------------------------------------------------------------------------


async def test_repeated_long_prompt_reports_cached_tokens(serve):
    server = await serve()
    async with aiohttp.ClientSession() as s:
        first = await post(s, server.url, LONG_A)
        second = await post(s, server.url, LONG_A)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # 175 tokens -> 10 full blocks of 16 can hit: 160 cached, the rest computed.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    st = await stats(server.url)
    assert (st["num_prompt_tokens_queried"], st["num_prompt_tokens_hit"]) == (350, 160)


async def test_third_distinct_prompt_evicts_the_least_recently_used(serve):
    # Capacity 320 tokens = 20 blocks: two 10-block prompts fit, a third evicts the first.
    server = await serve(scheduler=SchedulerSpec(320, 1e6, 2_000.0))
    async with aiohttp.ClientSession() as s:
        for tag in "abc":
            await post(s, server.url, long_prompt(tag))
        b_again = await post(s, server.url, long_prompt("b"))
        a_again = await post(s, server.url, long_prompt("a"))
    assert b_again["usage"]["prompt_tokens_details"]["cached_tokens"] == 144  # 9 blocks: the last is computed
    assert a_again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0



async def test_with_prefix_caching_off_nothing_is_kept_and_the_metrics_say_so(serve):
    server = await serve(scheduler=SchedulerSpec(prefill_tokens_per_s=1e6, prefix_caching=False))
    async with aiohttp.ClientSession() as s:
        replies = [await post(s, server.url, LONG_A) for _ in range(2)]
        async with s.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies] == [0, 0]
    assert 'enable_prefix_caching="False"' in metrics

# --- load ----------------------------------------------------------------------------------------------


async def test_a_burst_beyond_max_batch_queues(serve):
    # 6 requests x 20 tokens at 200 tok/s, 2 at a time: 3 rounds of ~100 ms, on a clock that moves when told.
    clock = FakeClock()
    server = await serve(scheduler=SchedulerSpec(32_768, 1e6, 200.0, max_batch=2), clock=clock)
    async with aiohttp.ClientSession() as s:
        burst = [asyncio.create_task(post(s, server.url, f"p{i}", max_tokens=20)) for i in range(6)]

        async def all_six_in() -> bool:
            st = await stats(server.url)
            return st["num_waiting"] + st["num_running"] == 6
        await eventually(all_six_in, "the six requests at the replica")
        async with s.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
        await clock.advance(1.0)  # the three rounds
        await asyncio.gather(*burst)
    assert 'vllm:num_requests_waiting{model_name="sim"} 4' in metrics
    assert 'vllm:num_requests_running{model_name="sim"} 2' in metrics
    assert "vllm:lora_requests_info{" in metrics and "running_lora_adapters=" in metrics
    # vLLM's KV size, as a gateway reads it: 32,768 tokens / 16 per block
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",' in metrics
    assert (await stats(server.url))["num_served"] == 6


# --- failure injection ---------------------------------------------------------------------------------


async def test_error500_answers_an_openai_error_before_any_byte(serve):
    server = await serve(failure=FailureSpec(FailMode.ERROR500))
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/v1/completions",
                                                    json={"model": "sim", "prompt": "x", "stream": True}) as r:
        assert r.status == 500
        assert (await r.json())["error"]["code"] == 500


async def test_refuse_closes_the_connection_without_a_response(serve):
    server = await serve(failure=FailureSpec(FailMode.REFUSE))
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            await post(s, server.url, "x")


async def test_stall_never_answers(serve):
    server = await serve(failure=FailureSpec(FailMode.STALL))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        with pytest.raises(asyncio.TimeoutError):
            await post(s, server.url, "x")


async def test_die_mid_stream_sends_some_chunks_then_drops(serve):
    server = await serve(failure=FailureSpec(FailMode.DIE_MID_STREAM, die_after_chunks=2))
    received = []
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(f"{server.url}/v1/completions",
                              json={"model": "sim", "prompt": "x", "stream": True, "max_tokens": 10}) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        received.append(line)
    assert len(received) == 2 and not any(b"[DONE]" in line for line in received)


async def test_slow_first_byte_delays_then_serves(serve):
    server = await serve(failure=FailureSpec(FailMode.SLOW_FIRST_BYTE, slow_first_byte_s=0.2))
    async with aiohttp.ClientSession() as s:
        start = time.monotonic()
        await post(s, server.url, "x", max_tokens=1)
        assert time.monotonic() - start >= 0.2


async def test_failures_start_after_n_good_requests_and_switch_at_runtime(serve):
    server = await serve(failure=FailureSpec(FailMode.ERROR500, fail_after_n=1))
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        statuses = []
        for _ in range(2):
            async with s.post(f"{server.url}/v1/completions", json=body) as r:
                statuses.append(r.status)
        async with s.post(f"{server.url}/admin/fail", json={"mode": "unavailable", "fail_after_n": 0}) as r:
            assert r.status == 200
        async with s.post(f"{server.url}/v1/completions", json=body) as r:
            statuses.append(r.status)
            assert r.headers["Retry-After"] == "1"
        async with s.get(f"{server.url}/health") as r:
            statuses.append(r.status)
    assert statuses == [200, 500, 503, 503]


async def test_client_disconnect_aborts_the_request(serve):
    server = await serve(scheduler=SchedulerSpec(32_768, 1e6, 20.0))  # 100 tokens would take 5 s
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{server.url}/v1/completions",
                         json={"model": "sim", "prompt": "x", "stream": True, "max_tokens": 100})
        await r.content.readline()
        r.close()
    st = await eventually(aborted_stats(server.url), "the request aborted")
    assert (st["num_aborted"], st["num_running"], st["num_served"]) == (1, 0, 0)


async def test_client_disconnect_aborts_a_non_streamed_request(serve):
    server = await serve(scheduler=SchedulerSpec(32_768, 1e6, 20.0))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as s:
        with pytest.raises(asyncio.TimeoutError):
            await post(s, server.url, "x", max_tokens=100)
    st = await eventually(aborted_stats(server.url), "the request aborted")
    assert (st["num_aborted"], st["num_running"]) == (1, 0)
