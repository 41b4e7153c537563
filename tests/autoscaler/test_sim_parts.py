"""The simulator's parts as a specification: trace loaders and transforms, the service model, the
event loop on hand-computed scenarios, and the baselines' published rules. Worked numbers in comments.

Everything here is in-process and takes milliseconds: the simulator has no I/O beyond reading a trace.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvgate.autoscaler.demand import ModelObservation
from kvgate.autoscaler.sim.baselines import (DynamoPlannerPolicy, KpaPolicy, LlmdSaturationPolicy, OraclePolicy,
                                             RayServePolicy, StaticPolicy, oracle_need)
from kvgate.autoscaler.sim.engine import simulate
from kvgate.autoscaler.sim.records import FleetSetup, Scenario, Stockout
from kvgate.autoscaler.sim.service import (Placement, PrefixCache, ServiceModel, SimConfigError, choose_placement,
                                           placements)
from kvgate.autoscaler.sim.traces import (BurstySpec, Request, Trace, TraceError, bursty_trace, compress_time,
                                          least_prefill_tokens, load_azure_csv, load_mooncake_jsonl, load_trace,
                                          scale_rate, with_warmup)
from kvgate.registry import load_registry
from kvgate.registry.schema import CapacityType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"


# ------------------------------------------------------------------------------------------ traces


def test_azure_csv_is_read_relative_to_its_first_request(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:46.1805900,10,0\n")  # out of order, and 0 output tokens
    trace = load_trace(path)
    assert [round(r.arrival_s, 3) for r in trace.requests] == [0.0, 0.5, 4.815]
    assert trace.requests[0] == Request(0.0, 10, 1)  # at least one token each way
    assert trace.requests[1].input_tokens == 374


def test_a_bad_row_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,374,44\nyesterday,1,1\n")
    with pytest.raises(TraceError, match=r"t\.csv:3:"):
        load_azure_csv(path)
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(Path(__file__))


def test_mooncake_timestamps_are_spread_inside_their_3s_bucket(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"timestamp": {ms}, "input_length": 512, "output_length": 9, "hash_ids": [1]}}\n'
                            for ms in (0, 0, 0, 3000)))
    trace = load_mooncake_jsonl(path, seed=1)
    assert len(trace.requests) == 4
    assert len({r.arrival_s for r in trace.requests}) == 4  # no ties left
    assert trace.duration_s < 6.0
    (path.parent / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: no field '\w+'; a Mooncake row has timestamp"):
        load_mooncake_jsonl(path.parent / "bad.jsonl")


def test_block_hashes_are_read_and_each_copy_of_a_scaled_trace_has_its_own(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 9, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 9000, "input_length": 1500, "output_length": 9, "hash_ids": [0, 2, 3]}\n')
    trace = load_mooncake_jsonl(path)
    assert trace.block_tokens == 512 and [r.blocks for r in trace.requests] == [(0, 1), (0, 2, 3)]
    # The second shares block 0 (512 tokens) with the first: it prefills at least 1,500 - 512 = 988.
    assert least_prefill_tokens(trace) == [1000, 988]
    doubled = scale_rate(trace, 2.0)
    assert sorted(r.blocks for r in doubled.requests) == [(0, 1), (0, 2, 3), (4, 5), (4, 6, 7)]
    assert least_prefill_tokens(doubled) == [1000, 1000, 988, 988]
    # The warm-up's mirrored prompts are their own too: nothing of the scored trace is cached by it.
    assert with_warmup(trace, 20.0).requests[0].blocks == (4, 6, 7)  # the second request, mirrored


def test_the_prefix_cache_keeps_the_most_recent_blocks() -> None:
    cache = PrefixCache(2)
    cache.insert((1, 2))
    assert cache.match((1, 3)) == 1 and cache.match((2,)) == 1 and cache.match((3, 1)) == 0
    cache.insert((1, 3))  # 1 and 3 used last: 2 goes
    assert cache.match((1, 3)) == 2 and cache.match((2,)) == 0


def test_a_shared_prefix_is_prefilled_once_and_its_holder_preferred() -> None:
    # Two replicas (1,000 prefill tokens/s, caches of 4 blocks of 100 tokens). Request 0 (blocks 0,1: 200 tokens)
    # goes to the first; request 1 (blocks 0,1,2: 300 tokens) at 1 s goes to the replica holding 0,1 and prefills
    # only its last 100 tokens: TTFT 0.1 s instead of 0.3 s. Request 2 (blocks 5,6) shares nothing: 0.2 s.
    service = ServiceModel("X", 1_000.0, 100.0, 10, kv_cache_tokens=400)
    fleet = _fleet(Placement("p", "node", CapacityType.ON_DEMAND, 2.0, 1, 100.0, service), initial=2)
    trace = Trace("prefix", (Request(0.0, 200, 1, (0, 1)), Request(1.0, 300, 1, (0, 1, 2)),
                             Request(2.0, 200, 1, (5, 6))), block_tokens=100)
    result = simulate(trace, fleet, StaticPolicy(2))
    assert result.ttft_s == pytest.approx((0.2, 0.1, 0.2))


def _steady(n: int, gap_s: float = 1.0, input_tokens: int = 100, output_tokens: int = 10) -> Trace:
    return Trace("steady", tuple(Request(i * gap_s, input_tokens, output_tokens) for i in range(n)))


def test_rate_scaling_keeps_the_timeline_and_compression_shortens_it() -> None:
    trace = _steady(1000)
    assert len(scale_rate(trace, 3.0).requests) == 3000
    thinned = len(scale_rate(trace, 0.5, seed=7).requests)
    assert 430 < thinned < 570  # binomial(1000, 0.5): within 4 standard deviations (15.8)
    assert scale_rate(trace, 3.0).duration_s == pytest.approx(999.0, abs=0.06)  # copies jitter <= 50 ms
    fast = compress_time(trace, 4.0)
    assert len(fast.requests) == 1000 and fast.duration_s == pytest.approx(999.0 / 4)


def test_warmup_mirrors_the_head_before_the_trace() -> None:
    trace = Trace("t", (Request(0.0, 1, 1), Request(2.0, 2, 2), Request(9.0, 3, 3)))
    warm = with_warmup(trace, 5.0)
    # 2.0 -> mirrored to 5 - 2 = 3.0; the original moves by 5 s. 9.0 is past the head: not mirrored.
    assert [(r.arrival_s, r.input_tokens) for r in warm.requests] == [(3.0, 2), (5.0, 1), (7.0, 2), (14.0, 3)]


def test_bursty_trace_has_idle_gaps_and_tenfold_spikes() -> None:
    spec = BurstySpec(duration_s=7200, base_rps=2.0, seed=3)
    trace = bursty_trace(spec)
    assert trace == bursty_trace(spec)  # deterministic per seed
    per_minute = [0] * 120
    for r in trace.requests:
        per_minute[int(r.arrival_s // 60)] += 1
    assert sum(1 for c in per_minute if c == 0) >= 10  # whole idle minutes
    assert max(per_minute) >= 8 * spec.base_rps * 60  # a minute inside a spike runs near 10 x 2/s = 1200
    assert min(r.input_tokens for r in trace.requests) >= 1


# ------------------------------------------------------------------------------------ service model


def test_service_model_worked_numbers() -> None:
    h100 = ServiceModel("H100", prefill_tokens_per_s=14_000, decode_tokens_per_s=1_600, max_batch=32)
    assert h100.prefill_s(1_400) == pytest.approx(0.1)  # 1,400 / 14,000
    # 51 output tokens: the first comes from prefill, 50 decoded at 1,600 / 32 = 50 tokens/s -> 1 s.
    assert h100.decode_s(51) == pytest.approx(1.0)


def test_placements_are_cheapest_first_and_respect_spot_and_gpu_kinds() -> None:
    snapshot = load_registry(EXAMPLES)
    chat = placements(snapshot, "chat-70b")
    # 4 of 8 H100s: spot p5 31.50 / 2 = 15.75, gpucloud 49.24 / 2 = 24.62, on-demand p5 55.04 / 2 = 27.52.
    assert [(p.key, round(p.price_usd_per_hour, 2)) for p in chat] == [
        ("aws-us-east-1/p5.48xlarge/spot", 15.75), ("gpucloud/h100-80gb-x8/on_demand", 24.62),
        ("aws-us-east-1/p5.48xlarge/on_demand", 27.52)]
    assert chat[0].cold_start_s == 240 + 90 and chat[1].cold_start_s == 90 + 90
    burst = placements(snapshot, "burst-8b")  # only the warm pool: 20 s pod start + 30 s load
    assert [(p.key, p.cold_start_s) for p in burst] == [("k8s-warm/l40s-x1/on_demand", 50.0)]
    assert chat[0].service.max_batch_tokens == 2048  # engine.max_batch_tokens: the step budget
    on_demand = choose_placement(chat, spot=False, unavailable=frozenset())
    assert on_demand is not None and on_demand.key == "gpucloud/h100-80gb-x8/on_demand"
    assert choose_placement(chat, spot=True, unavailable=frozenset({chat[0].key})) == chat[1]


def test_a_model_without_figures_for_its_gpu_is_a_config_error(tmp_path: Path) -> None:
    text = (EXAMPLES / "models.yaml").read_text().replace("- gpu_kind: H100\n", "- gpu_kind: A100-80GB\n", 1)
    (tmp_path / "models.yaml").write_text(text)
    (tmp_path / "pools.yaml").write_text((EXAMPLES / "pools.yaml").read_text())
    with pytest.raises(SimConfigError, match="chat-70b fits no offer"):
        placements(load_registry(tmp_path), "chat-70b")


# ------------------------------------------------------------------------------------------- engine


def _placement(capacity: CapacityType = CapacityType.ON_DEMAND, price: float = 2.0, cold_start_s: float = 100.0,
               max_batch: int = 1, key: str = "p") -> Placement:
    # 1,000 prefill tokens/s and 10 decode tokens/s per sequence (max_batch x 10 summed).
    return Placement(key, "node", capacity, price, 1, cold_start_s,
                     ServiceModel("X", 1_000.0, 10.0 * max_batch, max_batch))


def _fleet(*placements_: Placement, initial: int = 1, on_demand_base: int = 0, max_replicas: int = 10) -> FleetSetup:
    return FleetSetup("m", placements_ or (_placement(),), min_replicas=0, max_replicas=max_replicas,
                      on_demand_base=on_demand_base, ttft_slo_s=1.0, initial_replicas=initial, tail_s=100.0)


def test_one_slot_queues_the_second_request_behind_the_first() -> None:
    # Both ask 100 prompt tokens (0.1 s prefill) and 11 output tokens (10 decoded at 10/s: 1 s).
    trace = Trace("two", (Request(0.0, 100, 11), Request(0.5, 100, 11)))
    result = simulate(trace, _fleet(), StaticPolicy(1))
    # First: TTFT 0.1, done at 1.1. Second waits for the slot: first token at 1.1 + 0.1 = 1.2, TTFT 0.7.
    assert result.ttft_s == pytest.approx((0.1, 0.7))
    # One replica from 0 to the end (last arrival 0.5 + tail 100): 100.5 GPU-seconds at $2/h.
    assert result.gpu_seconds == pytest.approx(100.5)
    assert result.cost_usd == pytest.approx(100.5 * 2 / 3600)
    assert result.cold_starts == 0


def test_a_request_at_zero_replicas_waits_for_the_cold_start() -> None:
    trace = Trace("one", (Request(0.0, 100, 1), Request(50.0, 100, 1)))
    result = simulate(trace, _fleet(initial=0), StaticPolicy(1, tick_s=1.0))
    # The first tick (t=0) starts a replica: ready at 100 s, first token at 100.1 -> TTFT 100.1.
    assert result.ttft_s[0] == pytest.approx(100.1)
    # Arrived at 50, waited for the same replica, then for the first one's prefill: 100.2 - 50 = 50.2.
    assert result.ttft_s[1] == pytest.approx(50.2)
    assert result.cold_starts == 1


def test_prompts_that_arrive_together_prefill_in_engine_steps() -> None:
    trace = Trace("burst", tuple(Request(0.0, 500, 1) for _ in range(3)))
    result = simulate(trace, _fleet(_placement(max_batch=8)), StaticPolicy(1))
    # The first starts a step of its own 500 tokens (0.5 s at 1,000/s); the next two join the step after, 1,000
    # tokens within the 2,048 budget: their first tokens come together at 1.5 s (chunked prefill, as vLLM V1)
    assert result.ttft_s == pytest.approx((0.5, 1.5, 1.5))


def test_spot_interruptions_requeue_requests_and_are_replaced() -> None:
    # Every spot replica lives ~36 s on average; 400 requests of 2 s each over 400 s.
    trace = _steady(400, input_tokens=100, output_tokens=20)
    spot = _placement(CapacityType.SPOT, price=1.0, cold_start_s=5.0, max_batch=4)
    result = simulate(trace, _fleet(spot, initial=2), StaticPolicy(2, tick_s=1.0),
                      Scenario(spot_interruptions_per_hour=100.0, seed=1))
    assert result.preemptions >= 5
    assert result.cold_starts >= result.preemptions - 1  # each lost replica is replaced at the next tick
    assert all(not math.isnan(t) for t in result.ttft_s)  # nobody is lost: re-queued and served


def test_a_stocked_out_spot_offer_falls_back_to_on_demand() -> None:
    trace = _steady(100)
    spot = _placement(CapacityType.SPOT, price=1.0, key="pool/node/spot", cold_start_s=1.0)
    on_demand = _placement(CapacityType.ON_DEMAND, price=3.0, key="pool/node/on_demand", cold_start_s=1.0)
    scenario = Scenario(stockouts=(Stockout("pool/node/spot", 0.0, 1e9),))
    result = simulate(trace, _fleet(spot, on_demand, initial=0), StaticPolicy(1, tick_s=1.0), scenario)
    # Only on-demand was sold: 1 replica from t=0 to 99 + 100 tail = 199 s at $3/h.
    assert result.cost_usd == pytest.approx(199 * 3 / 3600)


def test_the_on_demand_base_is_bought_before_spot() -> None:
    spot = _placement(CapacityType.SPOT, price=1.0, key="s")
    on_demand = _placement(CapacityType.ON_DEMAND, price=3.0, key="o")
    result = simulate(_steady(10), _fleet(spot, on_demand, initial=3, on_demand_base=1), StaticPolicy(3))
    # 1 on-demand at $3 + 2 spot at $1 for 9 + 100 = 109 s.
    assert result.cost_usd == pytest.approx(109 * (3 + 1 + 1) / 3600)


# ---------------------------------------------------------------------------------------- baselines


def _obs(ongoing: int, ready: int, rps: float = 1.0) -> ModelObservation:
    return ModelObservation("m", 0, 0, ongoing, rps, None, ready, 0)


def test_kpa_stable_desire_uses_70_percent_of_the_target() -> None:
    kpa = KpaPolicy(target=10, min_replicas=1)
    state, decision = kpa.initial_state(), None
    for t in range(0, 62, 2):
        state, decision = kpa.decide(state, _obs(28, ready=4), float(t))
    # 28 ongoing / (10 x 0.7) = 4 replicas; 28 / 7 / 4 ready = 1 < 2: no panic.
    assert decision is not None and decision.desired == 4 and not decision.panic


def test_kpa_panics_at_twice_capacity_and_never_scales_down_in_panic() -> None:
    kpa = KpaPolicy(target=10, min_replicas=1)
    state = kpa.initial_state()
    for t in range(0, 60, 2):
        state, _ = kpa.decide(state, _obs(7, ready=1), float(t))
    # A burst: 70 ongoing over the 6 s panic window = 10 replicas wanted, 10 / 1 ready >= 2: panic.
    for t in range(60, 66, 2):
        state, decision = kpa.decide(state, _obs(70, ready=1), float(t))
    assert decision.panic and decision.desired == 10
    # Load vanishes: still panicking (less than a stable window since the last crossing), so no drop.
    state, decision = kpa.decide(state, _obs(0, ready=10), 70.0)
    assert decision.panic and decision.desired == 10
    # 60 s after the last crossing (t=64) panic ends and the stable window decides again.
    for t in range(72, 130, 2):
        state, decision = kpa.decide(state, _obs(0, ready=10), float(t))
    assert not decision.panic and decision.desired < 10


def test_ray_serve_waits_30s_to_scale_up_and_600s_to_scale_down() -> None:
    ray = RayServePolicy(target=10, min_replicas=1)
    state, _ = ray.decide(ray.initial_state(), _obs(10, ready=1), 0.0)
    ups = []
    for t in range(1, 40):
        state, decision = ray.decide(state, _obs(40, ready=1), float(t))
        ups.append(decision.desired)
    # The 30 s look-back mean passes 10 at t=1 (mean (10+40)/2 = 25 -> 3); 30 s of wanting more -> t=31.
    assert ups[29] == 1 and ups[30] > 1
    downs = []
    for t in range(40, 700):
        state, decision = ray.decide(state, _obs(0, ready=4), float(t))
        downs.append(decision.desired)
    first_drop = next(i for i, d in enumerate(downs) if d == 1)
    assert 600 <= first_drop <= 640  # the look-back must empty (30 s), then 600 s of wanting fewer


def test_llm_d_adds_one_replica_a_minute_while_saturated_and_removes_one_when_n_minus_1_is_safe() -> None:
    # 4 ready replicas of 32 slots running 104 (81% KV use >= 80%: saturated): the first decision (t=0) asks for
    # ready + 1 = 5, and nothing more for the 60 s interval, however saturated.
    llmd = LlmdSaturationPolicy(max_batch=32, min_replicas=1)
    state, decision = llmd.decide(llmd.initial_state(), _obs(104, ready=4), 0.0)
    assert decision.desired == 5
    for t in range(1, 60):
        state, decision = llmd.decide(state, _obs(104, ready=4), float(t))
        assert decision.desired == 5
    # 5 ready running 64 (40% KV): spare 0.4 >= 0.1; over 4 they would be at 50%, spare 0.3 >= 0.1: one fewer. But
    # the peak over the last minute (81%) decides: at t=60 it still sees 81% and asks for 6.
    state, decision = llmd.decide(state, _obs(64, ready=5), 60.0)
    assert decision.desired == 6
    for t in range(61, 180):
        state, decision = llmd.decide(state, _obs(64, ready=5), float(t))
    assert decision.desired == 4  # at t=120 (the minute's peak now 40%): 5 - 1


def test_dynamo_sizes_on_throughput_once_an_interval() -> None:
    # 20 requests/s of 1,000 prompt tokens and 250 output tokens; a replica prefills 14,000 tokens/s and decodes 1,600.
    # The first interval (180 s) only measures: the 2 replicas it found stay. At its end: prefill
    # ceil(20,000 / 14,000) = 2, decode ceil(20 x 250 / 1,600) = 4 -> 4, held for the next interval.
    dynamo = DynamoPlannerPolicy(prefill_tokens_per_s=14_000, decode_tokens_per_s=1_600, osl=250)
    obs = ModelObservation("m", 0, 0, 50, 20.0, None, 2, 0, prompt_tokens_per_s=20_000.0)
    state = dynamo.initial_state()
    for t in range(0, 180):
        state, decision = dynamo.decide(state, obs, float(t))
        assert decision.desired == 2
    state, decision = dynamo.decide(state, obs, 180.0)
    assert decision.desired == 4
    doubled = ModelObservation("m", 0, 0, 100, 40.0, None, 4, 0, prompt_tokens_per_s=40_000.0)
    for t in range(181, 360):
        state, decision = dynamo.decide(state, doubled, float(t))
        assert decision.desired == 4
    # At 360 the interval's mean is 40 requests/s: decode ceil(40 x 250 / 1,600) = ceil(6.25) = 7.
    state, decision = dynamo.decide(state, doubled, 360.0)
    assert decision.desired == 7


def test_oracle_need_and_lookahead_worked_numbers() -> None:
    service = ServiceModel("X", 1_000.0, 10.0, 1)  # 1 slot; 100 tokens in, 11 out: busy 0.1 + 1.0 s
    trace = Trace("t", (Request(0.0, 100, 11), Request(0.5, 100, 11), Request(30.0, 100, 11)))
    need = oracle_need(trace, service, 1.0)
    # Slots: busy [0, 1.1) and [0.5, 1.6): two at once in seconds 0 and 1. Prefill: 0.2 s of work in
    # second 0, averaged over the 10 s around each second: a fraction of a replica, so 1 in seconds 0-5.
    # (Prefilling 1% of the time, a replica decodes 1% slower: holds 1.11 s, the same seconds.)
    assert need[:3] == (2, 2, 1) and need[5] == 1 and need[15] == 0 and need[30] == 1
    oracle = OraclePolicy(need, cold_start_s=3.0)
    # At t=27 it looks at seconds 27..30: the request at 30 needs one replica started now.
    assert oracle.decide(None, _obs(0, ready=0), 27.0)[1].desired == 1
    assert oracle.decide(None, _obs(0, ready=0), 15.0)[1].desired == 0
