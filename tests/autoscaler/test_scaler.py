"""The replica scaler as a specification: table-driven, on a simulated timeline, worked numbers in comments.

Every test drives `decide_replicas` tick by tick (1 s ticks unless said otherwise) with observations
built here; no clock is read. Where a test needs "the replicas follow the decision", the fake fleet
below makes every desired replica ready `boot_s` seconds after it was asked for.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from kvgate.autoscaler.demand import ModelObservation, ScalerSpec
from kvgate.autoscaler.scaler import ReplicaDecision, ScalerState, decide_replicas
from kvgate.registry.schema import Scaling


def scaling(**kw: object) -> Scaling:
    base: dict[str, object] = dict(min_replicas=1, max_replicas=50, target_ongoing_requests=8.0,
                                   scale_down_delay_s=0.0, forecast_enabled=False)
    base.update(kw)
    if base["min_replicas"] == 0:
        base.setdefault("max_queue_wait_s", 120.0)
    return Scaling(**base)  # type: ignore[arg-type]


def obs(ongoing: float = 0, ready: int = 1, *, queued: int = 0, rps: float = 0.0, starting: int = 0) -> ModelObservation:
    return ModelObservation(model="m", queued_at_gateways=queued, waiting=0, running=int(ongoing),
                            arrivals_per_s=rps, ttft_p99_s=None, ready_replicas=ready, starting_replicas=starting)


def run(spec: ScalerSpec, load: Callable[[float], tuple[float, float]], *, start: float = 0.0, end: float,
        ready0: int = 1, boot_s: float = 0.0, step: float = 1.0,
        state: ScalerState | None = None) -> list[tuple[float, ReplicaDecision]]:
    """Drive the scaler from `start` to `end`; `load(t)` -> (ongoing, arrivals/s). Replicas asked for
    become ready `boot_s` later; fewer are ready at once."""
    state = state or ScalerState()
    ready, asked = ready0, [(start - boot_s, ready0)]
    out = []
    t = start
    while t < end:
        ongoing, rps = load(t)
        matured = [n for (ts, n) in asked if ts + boot_s <= t]
        ready = matured[-1] if matured else ready
        starting = max(0, asked[-1][1] - ready)
        queued = int(ongoing) if ready == 0 else 0
        o = ModelObservation("m", queued, 0, int(ongoing) - queued, rps, None, ready, starting)
        state, decision = decide_replicas(spec, state, o, t)
        if decision.desired != asked[-1][1]:
            if decision.desired < ready:
                ready = decision.desired  # stopping is immediate
            asked.append((t, decision.desired))
        out.append((t, decision))
        t += step
    return out


# ------------------------------------------------------------------------------------------- stable mode


@pytest.mark.parametrize("ongoing,ready,expected,panic", [
    (35, 3, 5, False),   # 35 in flight / target 8 = 4.375 -> 5 replicas; 5 / 3 ready < 2: no panic
    (16, 2, 2, False),   # exactly 2 x 8 -> 2 (no extra replica for float noise)
    (17, 2, 3, False),   # 17 / 8 = 2.125 -> 3
    (8, 4, 2, False),    # 8 / 8 = 1, but one decision may only halve: floor(4 / 2.0) = 2
    (400, 2, 20, True),  # 400 / 8 = 50, one decision may only grow 10x: ceil(2 x 10) = 20; 20/2 >= 2: panic
    (0, 1, 1, False),    # idle, min_replicas 1 -> 1
])
def test_stable_window_desired_is_ceil_concurrency_over_target(ongoing: int, ready: int, expected: int,
                                                               panic: bool) -> None:
    spec = ScalerSpec(scaling(max_replicas=100))
    state = ScalerState(desired=ready)
    for t in range(60):  # a whole stable window of the same load
        state, decision = decide_replicas(spec, state, obs(ongoing, ready), float(t))
    assert decision.desired == expected
    assert decision.panic is panic


def test_stable_average_spans_the_window_not_the_last_sample() -> None:
    # 50 s at 8 in flight then 10 s at 48: stable mean (50x8 + 10x48)/60 = 14.67 -> 2 replicas;
    # the panic window (6 s at 48) says 6 but 6 / 2 ready = 3 >= 2: that is a panic, tested below.
    # Here panic_threshold is 10, so only the stable value counts.
    spec = ScalerSpec(scaling(panic_threshold=10.0))
    state = ScalerState(desired=2)
    for t in range(60):
        state, decision = decide_replicas(spec, state, obs(8 if t < 50 else 48, 2), float(t))
    assert (decision.stable_desired, decision.panic_desired, decision.desired) == (2, 6, 2)


# -------------------------------------------------------------------------------------------- panic mode


def test_a_burst_panics_scales_at_once_and_never_scales_down_while_panicking() -> None:
    # 2 ready at 16 in flight (2 x 8: steady). From t=60 to t=69, 80 are in flight; then 16 again.
    # Replicas are ready as soon as asked (boot 0), scale_up_delay 30 s (panic skips it).
    # t=60: panic window (t 55..60) = (5x16 + 80)/6 = 26.7 -> 4; 4 / 2 ready = 2 >= 2: panic -> 4 at once.
    # t=61..65: the panic window fills with 80s: 5, 6, 8, 9, 10 (80/8); each / the ready count < 2, so
    #   t=60 stays the last crossing, but in panic the count follows the panic window upwards.
    # t=66..120: the burst ends, the panic window falls to 8..2, yet the count holds 10 (never down).
    # t=121: 61 s since the last crossing > stable window: calm. Stable mean over t 62..121 =
    #   (8x80 + 52x16)/60 = 24.5 -> 4, but one step may only halve: floor(10 / 2) = 5.
    # t=122: floor(5 / 2) = 2 .. stable 3 -> 3; then 2 once the burst leaves the window.
    spec = ScalerSpec(scaling(scale_up_delay_s=30.0))

    def load(t: float) -> tuple[float, float]:
        return (80.0 if 60 <= t < 70 else 16.0), 1.0

    trace = dict(run(spec, load, end=200, ready0=2))
    assert (trace[59].desired, trace[59].panic) == (2, False)
    assert [trace[t].desired for t in range(60, 66)] == [4, 5, 6, 8, 9, 10]
    assert all(trace[t].panic and trace[t].desired == 10 for t in range(65, 121))
    assert (trace[121].desired, trace[121].panic) == (5, False)
    assert trace[122].desired == 3
    assert trace[199].desired == 2


def test_no_panic_when_the_burst_is_below_the_threshold() -> None:
    # 4 ready; the panic window sees 56 -> 7 replicas; 7 / 4 = 1.75 < 2: no panic, stable mode only.
    spec = ScalerSpec(scaling())
    state = ScalerState(desired=4)
    for t in range(60):
        state, decision = decide_replicas(spec, state, obs(32 if t < 54 else 56, 4), float(t))
    assert not decision.panic
    assert decision.panic_desired == 7


# ------------------------------------------------------------------------------------------------ delays


def test_scale_up_delay_waits_for_continuous_demand() -> None:
    # Ray Serve's upscale_delay_s = 10: load doubles at t=60 (32 in flight -> 4 wanted vs 2), no panic
    # (threshold 10). The count moves at t=70 (10 s of wanting more), not before.
    spec = ScalerSpec(scaling(scale_up_delay_s=10.0, panic_threshold=10.0))
    trace = dict(run(spec, lambda t: (16.0 if t < 60 else 64.0, 1.0), end=90, ready0=2))
    assert all(trace[t].desired == 2 for t in range(60, 70))
    assert trace[70].desired > 2


def test_scale_down_delay_uses_the_highest_count_wanted_during_the_delay() -> None:
    # 6 ready at 48 in flight (6 x 8). At t=60 load falls to 8 (1 wanted by the end of the window),
    # but the stable mean falls slowly: 60 s later it reaches 8. With a 30 s down delay, the first
    # drop applies at t=90 to the highest count wanted in t=60..90: mean at t=60 =
    # (59x48 + 8)/60 = 47.3 -> 6 ... = 6 held; each later step lands 30 s after it was wanted.
    spec = ScalerSpec(scaling(scale_down_delay_s=30.0))
    trace = dict(run(spec, lambda t: (48.0 if t < 60 else 8.0, 1.0), end=240, ready0=6))
    downs = [t for t in range(61, 240) if trace[t].desired < trace[t - 1].desired]
    assert downs and downs[0] >= 90
    assert trace[239].desired == 1


# --------------------------------------------------------------------------------------- no flapping


@pytest.mark.parametrize("seed", range(10))
def test_noisy_steady_load_changes_the_count_at_most_twice_in_30_minutes(seed: int) -> None:
    # Noise: in flight ~ N(36, 6), arrivals ~ N(9, 1.5) /s, target 8 -> 4.5 -> 5 replicas.
    # 1800 ticks of 1 s, forecast on (cold start 120 s), down delay 30 s, replicas ready 60 s after
    # being asked for. At most 2 changes (one excursion and back). Measured over seeds 0..99: 96 runs
    # with 0 changes, 4 with 2 (see the report).
    rng = random.Random(seed)
    spec = ScalerSpec(scaling(scale_down_delay_s=30.0, forecast_enabled=True), cold_start_s=120.0)

    def load(t: float) -> tuple[float, float]:
        return max(0.0, round(rng.gauss(36, 6))), max(0.0, rng.gauss(9, 1.5))

    trace = run(spec, load, end=1800, ready0=5, boot_s=60.0)
    counts = [d.desired for _, d in trace]
    changes = sum(1 for a, b in zip(counts, counts[1:]) if a != b)
    assert changes <= 2, (changes, sorted(set(counts)))
    assert not any(d.panic for _, d in trace)


# ----------------------------------------------------------------------------------- scale to zero


def test_scale_to_zero_after_the_idle_grace_and_back_at_once_when_a_request_waits() -> None:
    # min_replicas 0, grace 300 s. Traffic until t=100, then nothing. The stable window empties by
    # t=160 (wants 0), but one replica stays until idle >= 300 s: t=399 is 299 s idle -> 1; t=400 -> 0.
    # At t=1000 one request is queued at a gateway with no replica: 0 -> 1 in that very tick,
    # without waiting for a window or a delay (scale_up_delay 60 s here).
    spec = ScalerSpec(scaling(min_replicas=0, scale_to_zero_grace_s=300.0, scale_up_delay_s=60.0))
    trace = dict(run(spec, lambda t: ((4.0, 1.0) if t <= 100 or t >= 1000 else (0.0, 0.0)), end=1005))
    assert trace[300].desired == 1 and trace[399].desired == 1
    assert "idle" in trace[399].reason
    assert trace[400].desired == 0
    assert all(trace[t].desired == 0 for t in range(400, 1000))
    assert trace[1000].desired == 1
    assert "scale from zero" in trace[1000].reason


def test_min_replicas_above_zero_never_scales_to_zero() -> None:
    spec = ScalerSpec(scaling(min_replicas=2, scale_to_zero_grace_s=0.0))
    trace = run(spec, lambda t: (0.0, 0.0), end=600, ready0=2)
    assert {d.desired for _, d in trace} == {2}


def test_max_replicas_caps_the_count() -> None:
    # 1000 in flight / 8 = 125 wanted; max 7.
    spec = ScalerSpec(scaling(max_replicas=7))
    trace = run(spec, lambda t: (1000.0, 10.0), end=30, ready0=7)
    assert {d.desired for _, d in trace} == {7}


# -------------------------------------------------------------------------------------------- forecast


def _first_time_at(trace: list[tuple[float, ReplicaDecision]], n: int) -> float:
    return next(t for t, d in trace if d.desired >= n)


def test_forecast_starts_replicas_one_cold_start_before_the_load_needs_them() -> None:
    # A ramp: arrivals 0.05 t /s, each request in the system 2 s (Little: in flight = 0.1 t).
    # Need: ceil(0.1 t / 8) replicas, i.e. 5 replicas from t = 320 s (32 in flight -> 4 ... 33 -> 5).
    # Without forecast the 60 s stable mean lags the ramp by 30 s: 5 replicas at ~t=350.
    # With the forecast (cold start 120 s) the rate 120 s ahead is used: 5 replicas at ~t=200,
    # one cold start before the need. Windows long, delays 0, panic off (threshold 10).
    cold = 120.0
    need_t = 320.0 + 1.0  # first t with 0.1 t > 32

    def load(t: float) -> tuple[float, float]:
        return 0.1 * t, 0.05 * t

    common = dict(panic_threshold=10.0, max_scale_up_rate=10.0)
    with_fc = run(ScalerSpec(scaling(forecast_enabled=True, **common), cold_start_s=cold), load, end=600, boot_s=cold)
    without = run(ScalerSpec(scaling(forecast_enabled=False, **common), cold_start_s=cold), load, end=600, boot_s=cold)
    t_fc, t_plain = _first_time_at(with_fc, 5), _first_time_at(without, 5)
    assert t_plain >= need_t  # reactive: only once the load is there (plus the window's lag)
    assert need_t - cold - 15 <= t_fc <= need_t - cold + 15, (t_fc, need_t)  # ~one cold start early
    # and the forecast's rps is the ramp 120 s ahead: at t=300, 0.05 x 420 = 21 /s (+-5 %)
    fc300 = dict(with_fc)[300.0].forecast_rps
    assert fc300 is not None and math.isclose(fc300, 21.0, rel_tol=0.05)


def test_forecast_switched_off_per_model_gives_no_forecast() -> None:
    spec = ScalerSpec(scaling(forecast_enabled=False), cold_start_s=120.0)
    trace = run(spec, lambda t: (0.1 * t, 0.05 * t), end=100)
    assert all(d.forecast_rps is None and d.forecast_desired == 0 for _, d in trace)


def test_forecast_never_lowers_the_count_on_a_falling_ramp() -> None:
    # Falling load: the forecast says less, the stable window rules alone (same as forecast off).
    on = run(ScalerSpec(scaling(forecast_enabled=True), cold_start_s=120.0),
             lambda t: (max(0.0, 80 - 0.1 * t), max(0.0, 40 - 0.05 * t)), end=600, ready0=10)
    off = run(ScalerSpec(scaling(forecast_enabled=False), cold_start_s=120.0),
              lambda t: (max(0.0, 80 - 0.1 * t), max(0.0, 40 - 0.05 * t)), end=600, ready0=10)
    assert [d.desired for _, d in on] == [d.desired for _, d in off]


def test_a_fresh_scaler_holds_the_replicas_that_exist_for_a_panic_window() -> None:
    # No state yet (first start or a restart), 3 ready + 1 starting, load for 1 (8 in flight): hold 4
    # while under 6 s of data, each warming tick keeping 4 for the down delay (30 s): the last, at t=5, until
    # t=35; then down.
    spec = ScalerSpec(scaling(scale_down_delay_s=30.0))
    state, trace = ScalerState(), {}
    for t in range(40):
        state, trace[t] = decide_replicas(spec, state, obs(8, 3, starting=1), float(t))
    assert trace[0].desired == 4 and "warming up" in trace[0].reason
    assert all(trace[t].desired == 4 for t in range(35))
    assert "down delay" in trace[6].reason
    assert trace[35].desired == 1  # 8 / 8 = 1; the lowest one step allows is floor(3 ready / 2) = 1

