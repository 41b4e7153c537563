"""The simulated replica in KV-events mode: it tokenizes and hashes prompts as a kvgate engine does and
speaks the replica-state protocol, so a gateway routes it on its KV block events.

Real servers throughout: sims on real sockets (HTTP and gRPC), the gateway app in process on a real
socket (as tests/router/test_gateway_engines.py builds it), and builtin:smollm2-135m's real tokenizer
(tests/engine/builtin_cache.py). The bench test runs the real `kvgate router` process in front of sim
processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from kvgate.engine.block_manager import BlockRemoved, BlockStored
from kvgate.kv_blocks import hash_blocks
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from loadtests import bench_routing
from loadtests.sim_replica import SimReplicaConfig, SimReplicaServer, start_sim_replica
from loadtests.sim_replica_model import PrefixCache, Scheduler, SchedulerSpec, SimSequence, stored_events
from loadtests.sim_state import SimTokens
from kvgate.router.prompt_tokens import prompt_token_ids
from kvgate.router.proxy import REPLICA_HEADER
from kvgate.router.membership import static_replica_id
from kvgate.router.replicas import ReplicaTracker
from tests.engine.builtin_cache import smollm2_dir
from tests.eventually import eventually
from tests.gateway_harness import running_gateway

MODEL = "sim-kv"
ADAPTER = "lora-kv"
FAST = SchedulerSpec(kv_capacity_tokens=8_192, prefill_tokens_per_s=1_000_000.0, decode_tokens_per_s=2_000.0)
LONG = "You are a careful assistant for the kvgate project, answering in short sentences. " * 20  # ~1,700 chars


@pytest.fixture(scope="module")
def tokens() -> SimTokens:
    return SimTokens.load(smollm2_dir())


@pytest.fixture
async def sims(tokens: SimTokens) -> AsyncIterator[list[SimReplicaServer]]:
    config = SimReplicaConfig(model=MODEL, adapters=(ADAPTER,), scheduler=FAST, tokenizer_dir=str(smollm2_dir()),
                              grpc_port=0)
    servers = [await start_sim_replica(config, tokens=tokens) for _ in range(2)]
    yield servers
    for server in servers:
        await server.close()


def apply(cached: set[int], state: replica_pb2.ReplicaState) -> None:
    """A subscriber's copy of the cache, as router.block_index applies the events: set updates in order."""
    for event in state.kv_events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            cached.update(event.stored.block_hashes)
        elif kind == "removed":
            cached.difference_update(event.removed.block_hashes)
        else:
            cached.clear()


# --- the pure cache ---------------------------------------------------------------------------------


def test_stored_events_split_new_blocks_into_runs_that_name_their_parent() -> None:
    assert stored_events([11, 22, 33, 44], [0, 2, 3], "a") == [BlockStored((11,), None, "a", 16),
                                                             BlockStored((33, 44), 22, "a", 16)]
    assert stored_events([11, 22], [], None) == []


def test_the_cache_records_what_enters_and_what_is_evicted_and_the_events_rebuild_it() -> None:
    cache = PrefixCache(capacity_blocks=5, record_events=True)
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 4, 5], "a")  # 1 and 2 are there: only 4 and 5 join, under parent 2
    first = cache.drain_events()
    assert first == [BlockStored((1, 2, 3), None, None, 16), BlockStored((4, 5), 2, "a", 16)]
    cache.insert([6, 7])  # chains are touched tail first: LRU order now 3, 5, 4, 2, 1, so 3 and 5 go
    second = cache.drain_events()
    assert second == [BlockStored((6, 7), None, None, 16), BlockRemoved((3, 5))]
    cache.insert([8, 9, 10])
    cache.insert([2, 4, 11])  # 2 and 4 were evicted by 8, 9, 10: stored again
    rebuilt: set[int] = set()
    for event in first + second + cache.drain_events():
        if isinstance(event, BlockStored):
            rebuilt |= set(event.block_hashes)
        else:
            rebuilt -= set(event.block_hashes)
    assert rebuilt == set(cache.block_hashes()) == {8, 9, 2, 4, 11}
    quiet = PrefixCache(2)  # the default: nothing recorded, the same LRU
    quiet.insert([1, 2, 3])
    assert quiet.drain_events() == [] and quiet.block_hashes() == [2, 1]


def test_kv_blocks_free_holds_a_block_that_running_sequences_share_once() -> None:
    sched = Scheduler(SchedulerSpec(kv_capacity_tokens=64 * 16, prefill_tokens_per_s=1e6))
    for seq_id in (1, 2):
        sched.add(SimSequence(seq_id, "m", 40, (11, 22), max_tokens=5))
    sched.complete(sched.schedule())  # both prefilled, a first token out each
    sched.complete(sched.schedule())  # a second token each
    assert sched.num_running == 2 and sched.num_kv_blocks_free() == 64 - 2 - 2 * 1
    sched.add(SimSequence(3, "m", 40, (33, 44), max_tokens=3))
    sched.complete(sched.schedule())  # another prompt: its own 2 full blocks and a private tail block
    assert sched.num_kv_blocks_free() == 60 - 3
    assert sched.kv_usage() == 1 - 57 / 64  # /metrics' vllm:kv_cache_usage_perc: the same count, as vLLM's


# --- the sims behind a gateway ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, sims: list[SimReplicaServer]) -> AsyncIterator[tuple[str, ReplicaTracker]]:
    static = ", ".join(f"{{url: '{s.url}', backend: kvgate, grpc_target: '{s.grpc_target}'}}" for s in sims)
    (tmp_path / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {MODEL}}}
spec:
  source: builtin:smollm2-135m
  routing: {{static_replicas: [{static}]}}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: {ADAPTER}}}
spec: {{base_model: {MODEL}, source: /adapters/{ADAPTER}, rank: 8}}
""")
    async with running_gateway(tmp_path) as (url, tracker):
        await eventually(lambda: tracker.kv_chain(MODEL) is not None)  # tokenizer fetched, streams synced
        yield url, tracker


async def test_a_gateway_routes_sims_on_their_kv_blocks_and_predicts_their_hits_to_the_token(
        tmp_path: Path, sims: list[SimReplicaServer], tokens: SimTokens) -> None:
    async with gateway(tmp_path, sims) as (url, tracker), aiohttp.ClientSession() as s:
        async with s.get(url + "/admin/stats") as r:
            stats = (await r.json())["models"][MODEL]
        assert stats["routes_on"] == "kv_blocks"
        assert {r["prefix_source"] for r in stats["replicas"]} == {"kv_events"}
        assert {r["kv_blocks_total"] for r in stats["replicas"]} == {8_192 // 16}
        realised_total = 0
        for model in (MODEL, ADAPTER):
            body = {"model": model, "messages": [{"role": "system", "content": LONG},
                                                 {"role": "user", "content": f"Question for {model}?"}],
                    "max_tokens": 2}
            served_by, cached = [], []
            for _ in range(4):
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    usage = (await r.json())["usage"]
                    served_by.append(r.headers[REPLICA_HEADER])
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            ids = prompt_token_ids(body, tokens.tokenizer)
            assert usage["prompt_tokens"] == len(ids)  # the sim counts as the engine (and the gateway) does
            assert len(set(served_by)) == 1, served_by
            # The adapter's chain shares no block with the base model's (same system prompt): cold first.
            assert cached[0] == 0 and cached[1:] == [(len(ids) - 1) // 16 * 16] * 3
            realised_total += sum(cached)
            index = tracker.blocks.get(served_by[0])
            # What the gateway predicted the sim held is what the sim served from cache, to the token...
            st = index.stats()
            assert st.predicted_cached_tokens_total == st.realised_cached_tokens_total
            assert st.num_corrections_total == 0
            # ...and the sim's events tell the gateway its whole chain, under the adapter's own hashes.
            chain = set(hash_blocks(ids, 16, model if model == ADAPTER else None))
            await eventually(lambda: chain <= index.cached)
        assert sum(tracker.blocks.get(static_replica_id(MODEL, i)).stats().realised_cached_tokens_total
                   for i in range(len(sims))) == realised_total


async def test_kv_events_after_evictions_match_the_sims_cache(tokens: SimTokens) -> None:
    """A 24-block sim gets ten distinct ~7-block prompts and some repeats: the stream's events, applied
    in order, give exactly the blocks the sim holds (as a fresh stream's resync and the cache itself say),
    and every `stored` event is a run of one prompt's chain with its parent."""
    config = SimReplicaConfig(model=MODEL, scheduler=SchedulerSpec(24 * 16, 1e6, 2_000.0),
                              tokenizer_dir=str(smollm2_dir()), grpc_port=0)
    sim = await start_sim_replica(config, tokens=tokens)
    bodies = [{"model": MODEL, "prompt": f"Prompt number {i}: " + LONG[:400], "max_tokens": 1} for i in range(10)]
    chains = [hash_blocks(prompt_token_ids(b, tokens.tokenizer), 16, None) for b in bodies]
    try:
        async with grpc.aio.insecure_channel(sim.grpc_target) as channel:
            stub = replica_pb2_grpc.ReplicaStub(channel)
            watch = stub.WatchState(replica_pb2.WatchStateRequest(include_kv_events=True, min_interval_ms=10))
            seen: set[int] = set()
            states: list[replica_pb2.ReplicaState] = []

            async def follow() -> None:
                async for state in watch:
                    states.append(state)
                    apply(seen, state)

            reader = asyncio.create_task(follow())
            await eventually(lambda: bool(states))
            async with aiohttp.ClientSession() as s:
                for body in bodies + bodies[7:] + bodies[:2]:  # 7..9 hit; 0 and 1 were evicted: stored again
                    async with s.post(sim.url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
            cache = sim.engine.scheduler.cache
            await eventually(lambda: seen == set(cache.block_hashes()))
            reader.cancel()
            fresh: set[int] = set()
            first = await stub.WatchState(replica_pb2.WatchStateRequest(include_kv_events=True)).read()
            apply(fresh, first)
            assert fresh == seen and len(seen) == 24
            events = [e for st in states for e in st.kv_events]
            assert events[0].WhichOneof("event") == "all_cleared"
            removed = [h for e in events if e.WhichOneof("event") == "removed" for h in e.removed.block_hashes]
            assert len(removed) >= 5 * 7  # at least 70 blocks went through a 24-block cache
            for e in events[1:]:
                if e.WhichOneof("event") != "stored":
                    continue
                run = list(e.stored.block_hashes)
                chain = next(c for c in chains if run[0] in c)
                start = chain.index(run[0])
                assert chain[start:start + len(run)] == run and e.stored.block_size_tokens == 16
                assert (e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None) == (
                    chain[start - 1] if start else None)
            state = await stub.GetState(replica_pb2.GetStateRequest())
            assert (state.num_kv_blocks_total, state.block_size_tokens, state.num_requests_running) == (24, 16, 0)
            # Only the repeats of 7..9 hit (3 chains of at most 8 blocks fit in 24); 0 and 1 had gone.
            lengths = [len(prompt_token_ids(b, tokens.tokenizer)) for b in bodies]
            assert max(len(c) for c in chains) <= 8
            assert state.prefix_cache_hit_tokens_total == sum((n - 1) // 16 * 16 for n in lengths[7:])
    finally:
        await sim.close()


def test_a_set_kv_events_false_tells_the_bench_not_to_wait_for_kv_block_routing() -> None:
    assert bench_routing.kv_events_off(["miss_cost_weight: 32", "kv_events:  False"])
    assert not bench_routing.kv_events_off(["kv_events: true"]) and not bench_routing.kv_events_off([])


def test_sim_kv_events_bench_waits_for_kv_block_routing(tmp_path: Path) -> None:
    """bench_routing --sim-kv-events: sim processes with gRPC ports behind the real `kvgate router`,
    which routes them on their KV blocks (the run waits until it does and records it)."""
    out = tmp_path / "sim-kv.json"
    bench_routing.main(["--sim-kv-events", "--replicas", "2", "--workloads", "hot_prefix", "--bursts", "1",
                        "--routers", "kvgate:cache_aware", "--out", str(out)])
    cell = json.loads(out.read_text())["cells"][0]
    res = cell["results"]["kvgate:cache_aware"]
    assert cell["mode"] == "sim-kv-events" and res["routes_on"] == "kv_blocks"
    assert res["num_failed"] == 0 and 0.3 < res["hit_rate"] <= cell["infinite_cache_hit_rate"] + 1e-9
