"""The replica-state stream: a real engine (builtin:tiny-llama), the real gRPC server on a loopback
port, and the generated client stub over a real channel.

What the router relies on: the first snapshot comes at once; a load change arrives within 250 ms; an
idle stream still sends a heartbeat at least every 250 ms; seq only grows; and with KV events, a
subscriber that replays the events of its stream holds exactly the replica's set of cached blocks.
Latencies are measured with the real clock; the wall-clock fields come from an injected one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.block_manager import hash_blocks
from kvgate.engine.core import EngineConfig
from kvgate.engine.sequence import SamplingParams
from kvgate.engine.state_service import (
    DEFAULT_MAX_INTERVAL_MS,
    StateService,
    StreamIntervals,
    next_send_at,
    start_state_service,
    stream_intervals,
)
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from tests.engine.builtin_cache import tiny_llama_dir

BLOCK_SIZE = 16
START_NS = 1_700_000_000_000_000_000  # the injected wall clock starts here and ticks 1 ms per read
SLACK_S = 0.05  # timer and scheduling jitter allowed on top of a 250 ms bound


@dataclass
class DrainSwitch:
    on: bool = False

    def __call__(self) -> bool:
        return self.on


@dataclass
class Replica:
    engine: AsyncLLM
    service: StateService
    stub: replica_pb2_grpc.ReplicaStub
    draining: DrainSwitch
    vocab_size: int
    recorders: list[Recorder] = field(default_factory=list)

    def watch(self, **request: object) -> Recorder:
        recorder = Recorder(self.stub.WatchState(replica_pb2.WatchStateRequest(**request)))
        self.recorders.append(recorder)
        return recorder

    def prompt(self, num_tokens: int, seed: int) -> list[int]:
        """Random token ids: a prefix no other test has cached."""
        rng = random.Random(seed)
        return [rng.randrange(self.vocab_size) for _ in range(num_tokens)]

    async def generate(self, prompt: list[int], max_tokens: int) -> float:
        """Run one request to the end; returns the real time its last token arrived."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for _ in self.engine.generate(prompt, params):
            pass
        return time.monotonic()


class Recorder:
    """Reads one WatchState stream in the background, noting when each snapshot arrived."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.arrivals: list[tuple[float, replica_pb2.ReplicaState]] = []
        self.error: grpc.aio.AioRpcError | None = None
        self._arrived = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for state in self.call:
                self.arrivals.append((time.monotonic(), state))
                self._arrived.set()
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        finally:
            self._arrived.set()

    @property
    def states(self) -> list[replica_pb2.ReplicaState]:
        return [state for _, state in self.arrivals]

    async def wait_for(self, predicate: Callable[[replica_pb2.ReplicaState], bool], *, start: int = 0,
                       timeout_s: float = 5.0) -> tuple[float, replica_pb2.ReplicaState]:
        """The first snapshot from index `start` on that satisfies `predicate`, and when it arrived."""
        async with asyncio.timeout(timeout_s):
            while True:
                for arrived_s, state in self.arrivals[start:]:
                    if predicate(state):
                        return arrived_s, state
                if self._task.done():
                    raise AssertionError(f"the stream ended ({self.error!r}) before the snapshot came")
                self._arrived.clear()
                await self._arrived.wait()

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def fake_now_ns() -> Callable[[], int]:
    ticks = itertools.count()
    return lambda: START_NS + next(ticks) * 1_000_000


async def start_replica(*, enable_kv_events: bool = True, **service_options: object) -> AsyncIterator[Replica]:
    config = EngineConfig(model=str(tiny_llama_dir()), kv_cache_bytes=4 << 20, max_num_seqs=8,
                          block_size=BLOCK_SIZE, enable_kv_events=enable_kv_events)
    engine = await AsyncLLM.create(config)
    draining = DrainSwitch()
    service = await start_state_service(engine, host="127.0.0.1", port=0, replica_id="tiny-llama-0",
                                        model="tiny-llama", is_draining=draining, now_ns=fake_now_ns(),
                                        **service_options)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    replica = Replica(engine, service, replica_pb2_grpc.ReplicaStub(channel), draining,
                      engine.core.runner.config.vocab_size)
    try:
        await replica.stub.GetState(replica_pb2.GetStateRequest(), timeout=5)  # connect once, up front
        yield replica
    finally:
        for recorder in replica.recorders:
            await recorder.close()
        await channel.close()
        await service.stop(grace=None)
        await engine.close()


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    async for running in start_replica():
        yield running


def replay(states: list[replica_pb2.ReplicaState]) -> set[int]:
    """The set of cached block hashes a subscriber holds after applying these snapshots' events."""
    cached: set[int] = set()
    for state in states:
        for event in state.kv_events:
            kind = event.WhichOneof("event")
            if kind == "all_cleared":
                cached.clear()
            elif kind == "stored":
                cached.update(event.stored.block_hashes)
            else:
                cached.difference_update(event.removed.block_hashes)
    return cached


# --- pacing (pure) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("min_ms,max_ms,expected", [
    (0, 0, StreamIntervals(0.05, 0.25)),  # the replica's defaults
    (100, 0, StreamIntervals(0.1, 0.25)),
    (0, 1000, StreamIntervals(0.05, 1.0)),
    (500, 0, StreamIntervals(0.5, 0.5)),  # a heartbeat below the coalescing interval is raised to it
])
def test_request_intervals_default_to_50_and_250_ms(min_ms: int, max_ms: int, expected: StreamIntervals) -> None:
    request = replica_pb2.WatchStateRequest(min_interval_ms=min_ms, max_interval_ms=max_ms)
    assert stream_intervals(request) == expected


@pytest.mark.parametrize("last_sent_s,changed,expected_s", [
    (10.0, True, 10.05),  # a change goes out one coalescing interval after the last snapshot
    (10.0, False, 10.25),  # no change: the heartbeat
    (float("-inf"), False, float("-inf")),  # nothing sent yet: due at once
])
def test_next_send_is_a_coalescing_interval_after_a_change_else_a_heartbeat(
        last_sent_s: float, changed: bool, expected_s: float) -> None:
    assert next_send_at(last_sent_s, changed, StreamIntervals(0.05, 0.25)) == pytest.approx(expected_s)


# --- GetState ----------------------------------------------------------------------------------------


async def test_get_state_reports_the_engine_snapshot(replica: Replica) -> None:
    state = await replica.stub.GetState(replica_pb2.GetStateRequest(), timeout=5)

    stats = replica.engine.stats
    assert (state.replica_id, state.model) == ("tiny-llama-0", "tiny-llama")
    assert (state.num_requests_waiting, state.num_requests_running) == (0, 0)
    assert state.num_kv_blocks_total == stats.num_kv_blocks_total > 0
    assert state.num_kv_blocks_free == state.num_kv_blocks_total  # idle: every block is free
    assert state.block_size_tokens == BLOCK_SIZE
    assert list(state.adapters_loaded) == []
    assert (state.prefix_cache_queried_tokens_total, state.prefix_cache_hit_tokens_total) == (0, 0)
    assert state.draining is False
    assert state.process_start_unix_ns == START_NS  # the injected clock's first reading
    assert state.wall_time_unix_ns > state.process_start_unix_ns
    assert state.seq >= 1
    assert list(state.kv_events) == []


async def test_get_state_counts_prefix_cache_hits(replica: Replica) -> None:
    prompt = replica.prompt(40, seed=1)  # 2 full blocks + 8 tokens
    await replica.generate(prompt, max_tokens=1)
    await replica.generate(prompt, max_tokens=1)  # the second time, 32 tokens hit

    state = await replica.stub.GetState(replica_pb2.GetStateRequest(), timeout=5)

    assert state.prefix_cache_queried_tokens_total == 80
    assert state.prefix_cache_hit_tokens_total == 32


# --- WatchState: pacing ------------------------------------------------------------------------------


async def test_the_first_snapshot_comes_at_once(replica: Replica) -> None:
    opened_s = time.monotonic()
    stream = replica.watch(include_kv_events=True, max_interval_ms=5_000)  # a heartbeat would take 5 s

    arrived_s, first = await stream.wait_for(lambda state: True)

    assert arrived_s - opened_s < 0.25
    assert (first.replica_id, first.model) == ("tiny-llama-0", "tiny-llama")


async def test_a_load_change_reaches_the_stream_within_250_ms(replica: Replica) -> None:
    stream = replica.watch()
    await stream.wait_for(lambda state: True)

    started_s = time.monotonic()
    # Long enough to outlast the test on any machine; cancelling the reader aborts it (finishes it).
    request = asyncio.create_task(replica.generate(replica.prompt(20, seed=2), max_tokens=1_000))
    busy_s, busy = await stream.wait_for(lambda state: state.num_requests_running == 1)
    finished_s = time.monotonic()
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    idle_s, idle = await stream.wait_for(lambda state: state.num_requests_running == 0,
                                         start=stream.states.index(busy))

    assert busy_s - started_s < 0.25
    assert idle_s - finished_s < 0.25
    assert idle.num_kv_blocks_free == idle.num_kv_blocks_total


async def test_an_idle_stream_sends_a_heartbeat_at_least_every_250_ms(replica: Replica) -> None:
    stream = replica.watch()
    await stream.wait_for(lambda state: True)

    await stream.wait_for(lambda state: True, start=4)  # four heartbeats after the first snapshot

    arrivals = [arrived_s for arrived_s, _ in stream.arrivals]
    gaps_s = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert len(arrivals) >= 4
    assert max(gaps_s) <= DEFAULT_MAX_INTERVAL_MS / 1000 + SLACK_S
    # Nothing changes, so every snapshot is a heartbeat: none comes early.
    assert min(gaps_s) >= DEFAULT_MAX_INTERVAL_MS / 1000 - SLACK_S


async def test_seq_strictly_increases_on_every_stream_and_across_streams(replica: Replica) -> None:
    first, second = replica.watch(), replica.watch(min_interval_ms=10, max_interval_ms=100)
    request = asyncio.create_task(replica.generate(replica.prompt(20, seed=3), max_tokens=10))
    one_off = [await replica.stub.GetState(replica_pb2.GetStateRequest(), timeout=5) for _ in range(3)]
    await request
    for stream in (first, second):  # a few snapshots each, the request's and heartbeats after it
        await stream.wait_for(lambda state: True, start=2)

    for stream in (first, second):
        seqs = [state.seq for state in stream.states]
        assert len(seqs) >= 2
        assert all(earlier < later for earlier, later in itertools.pairwise(seqs))
    every_seq = [state.seq for state in [*first.states, *second.states, *one_off]]
    assert len(set(every_seq)) == len(every_seq)  # one counter for the whole replica


async def test_the_draining_flag_follows_is_draining(replica: Replica) -> None:
    stream = replica.watch(max_interval_ms=5_000)
    await stream.wait_for(lambda state: True)

    replica.draining.on = True
    replica.service.notify_changed()
    changed_s = time.monotonic()
    arrived_s, _ = await stream.wait_for(lambda state: state.draining)
    state = await replica.stub.GetState(replica_pb2.GetStateRequest(), timeout=5)

    assert arrived_s - changed_s < 0.25
    assert state.draining is True


async def test_stopping_the_service_ends_streams_with_unavailable(replica: Replica) -> None:
    stream = replica.watch()
    await stream.wait_for(lambda state: True)

    await replica.service.stop(grace=1.0)
    await asyncio.wait_for(stream._task, timeout=5)

    assert stream.error is not None
    assert stream.error.code() is grpc.StatusCode.UNAVAILABLE


# --- WatchState: KV events ---------------------------------------------------------------------------


async def test_the_stream_reports_the_blocks_a_prompt_stored(replica: Replica) -> None:
    stream = replica.watch(include_kv_events=True)
    _, first = await stream.wait_for(lambda state: True)
    prompt = replica.prompt(40, seed=4)  # 2 full blocks + 8 tokens
    expected = hash_blocks(prompt, BLOCK_SIZE, adapter=None)

    await replica.generate(prompt, max_tokens=4)  # 44 tokens: still 2 full blocks
    _, state = await stream.wait_for(
        lambda state: any(event.stored.block_hashes == expected for event in state.kv_events))

    assert first.kv_events[0].WhichOneof("event") == "all_cleared"
    stored = next(event.stored for event in state.kv_events if event.stored.block_hashes == expected)
    assert not stored.HasField("parent_block_hash")  # the chain starts the prompt
    assert (stored.adapter, stored.block_size_tokens) == ("", BLOCK_SIZE)
    assert replay(stream.states) == set(expected)


async def test_a_new_subscriber_starts_from_all_cleared_and_every_cached_hash(replica: Replica) -> None:
    prompt = replica.prompt(50, seed=5)  # 3 full blocks
    await replica.generate(prompt, max_tokens=1)
    cached = replica.engine.core.block_manager.cached_block_hashes()  # the engine is idle: a safe read

    stream = replica.watch(include_kv_events=True)
    _, first = await stream.wait_for(lambda state: True)

    kinds = [event.WhichOneof("event") for event in first.kv_events]
    assert kinds == ["all_cleared", "stored"]
    snapshot = first.kv_events[1].stored
    assert set(snapshot.block_hashes) == set(cached) >= set(hash_blocks(prompt, BLOCK_SIZE))
    assert not snapshot.HasField("parent_block_hash")  # a set of hashes, not one chain


async def test_without_kv_events_asked_the_stream_carries_none(replica: Replica) -> None:
    stream = replica.watch()
    await stream.wait_for(lambda state: True)

    await replica.generate(replica.prompt(40, seed=6), max_tokens=1)
    await stream.wait_for(lambda state: state.prefix_cache_queried_tokens_total > 0)

    assert all(len(state.kv_events) == 0 for state in stream.states)


async def test_a_stream_that_falls_behind_is_resynced_from_a_full_snapshot() -> None:
    # A buffer of one hash between sends: any prompt with 2 full blocks overflows it.
    async for replica in start_replica(max_pending_kv_hashes=1):
        stream = replica.watch(include_kv_events=True)
        await stream.wait_for(lambda state: True)
        prompt = replica.prompt(40, seed=7)

        await replica.generate(prompt, max_tokens=1)
        _, resync = await stream.wait_for(lambda state: len(state.kv_events) > 0, start=1)

        assert resync.kv_events[0].WhichOneof("event") == "all_cleared"
        assert set(resync.kv_events[1].stored.block_hashes) >= set(hash_blocks(prompt, BLOCK_SIZE))
        assert replay(stream.states) == set(replica.engine.core.block_manager.cached_block_hashes())


async def test_an_engine_without_kv_events_streams_none_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    async for replica in start_replica(enable_kv_events=False):
        with caplog.at_level(logging.WARNING, logger="kvgate.engine.state"):
            stream = replica.watch(include_kv_events=True)
            await stream.wait_for(lambda state: True)
            await replica.generate(replica.prompt(40, seed=8), max_tokens=1)
            await stream.wait_for(lambda state: state.prefix_cache_queried_tokens_total > 0)

        assert all(len(state.kv_events) == 0 for state in stream.states)
        assert "enable_kv_events" in caplog.text
