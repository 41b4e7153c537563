"""The routing benchmarks' new parts: real-engine mode, replica kill, two gateways, and their pure helpers.

The end-to-end runs are small versions of the real benchmarks (real `kvgate router` processes, real
`kvgate engine` processes on tiny-llama, simulated replicas in their own processes, a real SIGKILL); they
check that each script measures what it says, not the numbers themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import bench_routing, bench_routing_faults, bench_routing_gateways, workloads
from loadtests.routing_fleet import parse_engine_counters
from kvgate.router.policies import RoutingKnobs


def req(text: str, model: str = "m", kind: str = "hot") -> workloads.Request:
    return workloads.Request(0.0, model, ({"role": "user", "content": text},), 4, kind)


def test_previous_with_prefix_needs_half_the_prompt_and_the_same_model() -> None:
    a = "x" * 100
    reqs = [req(a), req(a + "y" * 50), req("z" * 100), req(a + "w" * 120), req(a, model="lora")]
    # 2: nothing shared; 3: shares ~100 of ~240 chars (< half); 4: same text, other adapter
    assert bench_routing_gateways.previous_with_prefix(reqs) == [None, 0, None, None, None]
    reqs.append(req(a + "y" * 150))  # its first half runs into the y s: only 1 shares it, not 3
    assert bench_routing_gateways.previous_with_prefix(reqs)[-1] == 1  # the latest one, not the first


def test_same_replica_share_counts_only_answered_repeats() -> None:
    results = [{"replica": "r1", "kind": "hot"}, {"replica": "r1", "kind": "hot"},
               {"replica": "r2", "kind": "conversation"}, {"replica": None, "kind": "hot"}]
    share = bench_routing_gateways.same_replica_share(results, [None, 0, 1, 0])
    assert share["repeated_prefix_requests"] == 2 and share["same_replica"] == 1 and share["share"] == 0.5
    assert share["by_kind"]["conversation"] == {"same": 0, "total": 1, "share": 0.0}


def test_home_replica_share_accepts_any_replica_an_earlier_request_with_the_prefix_went_to() -> None:
    a = "x" * 100
    reqs = [req(a), req(a + "1"), req(a + "2"), req(a + "3"), req("z" * 100)]
    earlier = bench_routing_gateways.earlier_with_prefix(reqs)
    assert earlier == [[], [0], [0, 1], [0, 1, 2], []]
    # The prefix lives on r1 and then also on r2 (spread by the load bound): request 3 on r2 counts.
    results = [{"replica": r, "kind": "hot"} for r in ("r1", "r2", "r1", "r2")] + [{"replica": "r3", "kind": "hot"}]
    share = bench_routing_gateways.home_replica_share(results, earlier)
    # 1 (r2 not yet a home: miss), 2 (r1: hit), 3 (r2 is a home by then: hit); 4 repeats nothing
    assert (share["repeated_prefix_requests"], share["to_a_home"]) == (3, 2)


def test_home_replica_share_weighted_by_the_repeated_prefix() -> None:
    a = "x" * 100
    reqs = [req(a), req(a + "y" * 20), req("z" * 30), req("z" * 30 + "w" * 10), req(a + "y" * 20 + "v")]
    prev = bench_routing_gateways.previous_with_prefix(reqs)
    assert prev == [None, 0, None, 2, 1]
    weights = bench_routing_gateways.repeated_prefix_chars(reqs, prev)
    texts = [r.prompt_text() for r in reqs]
    assert weights[0] == weights[2] == 0 and 100 < weights[1] < len(texts[1]) and weights[3] < weights[1]
    assert texts[1][:weights[1]] == texts[0][:weights[1]] and texts[1][weights[1]] != texts[0][weights[1]]
    assert bench_routing_gateways.common_prefix_chars("abcd", "abxd") == 2
    assert bench_routing_gateways.common_prefix_chars("ab", "abc") == 2
    # 1 and 4 repeat the long prompt at its home; 3 repeats the short one elsewhere
    results = [{"replica": r, "kind": "hot"} for r in ("r1", "r1", "r2", "r3", "r1")]
    share = bench_routing_gateways.home_replica_share(results, bench_routing_gateways.earlier_with_prefix(reqs),
                                                      weights)
    assert (share["repeated_prefix_requests"], share["to_a_home"]) == (3, 2)
    assert share["chars_share"] == (weights[1] + weights[4]) / (weights[1] + weights[3] + weights[4]) > 2 / 3


def test_classify_splits_failures_by_what_the_client_saw() -> None:
    results = [{"ok": True, "streamed": True, "error_event": False},
               {"ok": False, "streamed": False, "error_event": False},
               {"ok": False, "streamed": True, "error_event": True},
               {"ok": False, "streamed": True, "error_event": False}]
    assert bench_routing_faults.classify(results) == {
        "failed": 3, "failed_before_first_byte": 1, "broken_mid_stream": 2, "broken_with_sse_error_event": 1}


def test_engine_workload_scaling_and_token_replay() -> None:
    hot = workloads.hot_prefix("m", 2, 1.0, text_scale=1 / 8)
    assert len(hot[0].messages[0]["content"]) in (750, 150, 375)  # hot, conversation or LoRA system prompt
    cut = workloads.mooncake("m", 50, 8.0, block_chars=16, max_blocks=4)
    assert max(len(r.messages[0]["content"]) for r in cut) <= 64
    # One token per character: the second prompt repeats the first one's 2 full blocks.
    replay = workloads.token_replay([req("a" * 40), req("a" * 40 + "b")], lambda r: [ord(c) for c in r.messages[0]
                                                                                      ["content"]], block_tokens=16)
    assert replay["prompt_tokens"] == 81 and replay["best_hit_rate"] == 32 / 81
    assert replay["unique_tokens"] == 32 and replay["prompt_tokens_max"] == 41
    assert replay["best_hit_rate_by_kind"] == {"hot": 32 / 81}
    replay = workloads.token_replay([req("a" * 40), req("a" * 40 + "b", kind="lora")],
                                    lambda r: [ord(c) for c in r.messages[0]["content"]], block_tokens=16)
    assert replay["best_hit_rate_by_kind"] == {"hot": 0.0, "lora": 32 / 41}


def test_the_hit_rate_by_kind_comes_from_the_responses_usage() -> None:
    def result(kind: str, prompt: int | None, cached: int | None) -> dict:
        return {"ok": True, "ttft": 0.1, "tokens": 4, "end": 1.0, "kind": kind, "replica": None, "error": None,
                "prompt_tokens": prompt, "cached_tokens": cached}

    results = [result("hot", 100, 80), result("hot", 100, 100), result("lora", 50, 0), result("lora", 10, None)]
    summary = bench_routing.summarize(results, [], [], {}, 0.0, len(results))
    assert summary["usage_hit_rate_by_kind"] == {
        "hot": {"prompt_tokens": 200, "cached_tokens": 180, "hit_rate": 0.9},
        "lora": {"prompt_tokens": 50, "cached_tokens": 0, "hit_rate": 0.0}}  # one without cached_tokens: left out


def test_engine_counters_are_parsed_from_prometheus_text() -> None:
    text = """# TYPE kvgate_engine_prefix_queried_tokens_total counter
kvgate_engine_prefix_queried_tokens_total 120.0
kvgate_engine_prefix_hit_tokens_total 64.0
kvgate_engine_requests_finished_total{finish_reason="length"} 3.0
kvgate_engine_requests_finished_total{finish_reason="abort"} 1.0
"""
    assert parse_engine_counters(text) == {"num_prompt_tokens_queried": 120.0, "num_prompt_tokens_hit": 64.0,
                                           "num_requests": 4.0}


def test_engines_mode_reads_hits_from_real_engines(tmp_path: Path) -> None:
    """2 real tiny-llama engines behind kvgate cache_aware: the engines' own counters see the prompt tokens the
    benchmark's tokenized replay predicts, and the second half of a burst on one system prompt hits."""
    out = tmp_path / "engines.json"
    bench_routing.main(["--engines", "--replicas", "2", "--workloads", "hot_prefix", "--bursts", "1",
                        "--routers", "kvgate:cache_aware", "--out", str(out)])
    cell = json.loads(out.read_text())["cells"][0]
    res = cell["results"]["kvgate:cache_aware"]
    assert cell["mode"] == "engines" and res["num_failed"] == 0 and res["num_ok"] == 100
    # what the engines counted (+ the readiness ping, a few tokens) vs the tokenizer replay
    assert 0 <= res["prompt_tokens_queried"] - cell["workload_summary"]["prompt_tokens"] < 50
    assert 0.3 < res["hit_rate"] <= cell["infinite_cache_hit_rate"] + 1e-9
    assert 1.0 < cell["workload_summary"]["chars_per_token"] < 2.0  # tiny-llama: far fewer than 4


def test_a_killed_replica_costs_kvgate_no_request_before_streaming(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    bench_routing_faults.main(["--routers", "kvgate:cache_aware", "--bursts", "2", "--kill-at-s", "0.2",
                               "--out", str(out)])
    (res,) = json.loads(out.read_text())["results"].values()
    assert res["killed_pid"] > 0 and res["requests_served_before_kill"][0] is not None
    assert res["failed_before_first_byte"] == 0
    assert res["num_ok"] + res["broken_mid_stream"] == 200


def test_two_gateways_report_same_replica_share_and_hit_rate(tmp_path: Path) -> None:
    out = tmp_path / "gateways.json"
    bench_routing_gateways.main(["--workloads", "hot_prefix", "--bursts", "2", "--out", str(out)])
    (cell,) = json.loads(out.read_text())["cells"]
    for gateways in ("1", "2"):
        res = cell["results"][gateways]
        assert res["num_failed"] == 0 and res["hit_rate"] > 0
        # burst 2 repeats every conversation and the hot and LoRA system prompts of burst 1
        assert res["same_replica"]["repeated_prefix_requests"] >= 150
        assert 0.0 <= res["same_replica"]["share"] <= 1.0


def test_the_routing_replay_is_deterministic_and_cache_aware_beats_least_load_on_hits() -> None:
    from loadtests import routing_replay
    from kvgate.registry.schema import Routing, RoutingPolicy
    from kvgate.router.policies import RoutingKnobs

    reqs = workloads.hot_prefix(routing_replay.MODEL, 3, 2.0)
    spec = routing_replay.bench_spec(reqs, 4)
    cache_aware = RoutingKnobs.from_routing(Routing())
    first = routing_replay.replay(reqs, 4, spec, cache_aware)
    assert routing_replay.replay(reqs, 4, spec, cache_aware) == first  # no clock, no randomness left
    assert len(first.ttft_by_request) == len(reqs) and first.max_over_mean_load <= 1.25
    # Each request's cached tokens (what a loss analysis compares with the best) add up to the replicas' counters.
    prompt_tokens = sum(tokens for tokens, _ in workloads.infinite_cache_hits(reqs))
    assert len(first.cached_by_request) == len(reqs)
    assert sum(first.cached_by_request.values()) / prompt_tokens == pytest.approx(first.hit_rate)
    least = routing_replay.replay(reqs, 4, spec, RoutingKnobs.from_routing(Routing(policy=RoutingPolicy.LEAST_LOAD)))
    best = workloads.infinite_cache_hit_rate(reqs)
    assert least.hit_rate < first.hit_rate <= best
    # Two gateways sharing nothing: every request was routed by one of them, and the agreement figure
    # is the bench's own.
    two = routing_replay.replay(reqs, 4, spec, cache_aware, num_gateways=2)
    share, chars_share = routing_replay.to_a_holder_share(reqs, two.replica_by_request)
    assert len(two.replica_by_request) == len(reqs) and 0.5 < share <= 1.0 and 0.5 < chars_share <= 1.0
    oracle = routing_replay.replay(reqs, 4, spec, cache_aware, policy="oracle")
    sglang = routing_replay.replay(reqs, 4, spec, cache_aware, policy=routing_replay.SglangLike())
    assert oracle.hit_rate > least.hit_rate and sglang.hit_rate > least.hit_rate


async def test_the_decision_bench_sides_choose_alike_so_only_their_cost_differs() -> None:
    from loadtests import bench_routing_decision as bench
    from kvgate.registry.schema import Routing

    routing = Routing()
    routes = bench.make_routes(300, routing.prefix_chunk_chars, routing.affinity_depth_chars)
    knobs = RoutingKnobs.from_routing(routing)
    _, kept = await bench.replay(8, routes, knobs, bench.kept_view)
    _, rebuilt = await bench.replay(8, routes, knobs, bench.rebuilt_view)
    assert kept == rebuilt  # the kept states are never stale: every decision matches the rebuilt view's
    assert len(set(kept)) == 8  # and the replay spreads over the fleet, so states change between decisions


def test_the_ttft_floor_is_each_prompts_uncached_part_at_prefill_speed_and_no_replay_beats_it() -> None:
    from loadtests import routing_replay
    from loadtests.sim_replica_model import SchedulerSpec
    from kvgate.registry.schema import Routing
    from kvgate.router.policies import RoutingKnobs

    system = {"role": "system", "content": "s" * 4000}
    first = workloads.Request(0.0, routing_replay.MODEL, (system, {"role": "user", "content": "a"}), 8, "hot")
    again = workloads.Request(0.1, routing_replay.MODEL, (system, {"role": "user", "content": "b"}), 8, "hot")
    (tokens_1, hit_1), (tokens_2, hit_2) = workloads.infinite_cache_hits([first, again])
    assert hit_1 == 0 and 900 < hit_2 < tokens_2  # the second finds the system prompt, not its own question
    spec = SchedulerSpec(kv_capacity_tokens=1 << 20, prefill_tokens_per_s=1000.0, decode_tokens_per_s=50.0)
    assert routing_replay.ttft_floor_s([first, again], spec) == [tokens_1 / 1000, (tokens_2 - hit_2) / 1000]

    reqs = workloads.hot_prefix(routing_replay.MODEL, 2, 2.0)
    spec = routing_replay.bench_spec(reqs, 4)
    floors = routing_replay.ttft_floor_s(reqs, spec)
    res = routing_replay.replay(reqs, 4, spec, RoutingKnobs.from_routing(Routing()))
    assert all(res.ttft_by_request[i] >= floor - 1e-9 for i, floor in enumerate(floors))
