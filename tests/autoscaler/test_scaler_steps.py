"""The scaler's steps one at a time: each pure piece that `decide_replicas` runs, table-driven with
worked numbers. `test_scaler.py` specifies the whole decision over a timeline; these pin the parts, so
that a change to one rule (the windows, the panic clock, the delays, zero) shows where it lands.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.autoscaler.forecast import ForecastState
from kvgate.autoscaler.demand import Demand, RateBounds, Sample, ScalerSpec, forecast_concurrency, measure_demand
from kvgate.autoscaler.scaler import (
    ScalerState,
    Step,
    apply_delays,
    guard_scale_to_zero,
    most_wanted,
    next_panic_over_at,
    remember_wanted,
    wake_from_zero,
    within_limits,
)
from kvgate.registry.schema import Scaling


def scaling(**kw: object) -> Scaling:
    base: dict[str, object] = dict(min_replicas=1, max_replicas=50, target_ongoing_requests=8.0,
                                   forecast_enabled=False)
    base.update(kw)
    if base["min_replicas"] == 0:
        base.setdefault("max_queue_wait_s", 120.0)
    return Scaling(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ the rate bounds


@pytest.mark.parametrize("ready,max_down,max_up", [
    (4, 2, 40),  # floor(4 / 2) = 2; ceil(4 x 10) = 40
    (3, 1, 30),  # floor(1.5) = 1
    (1, 0, 10),
    (0, 0, 10),  # the up bound counts at least one ready replica, so 0 -> N is possible
])
def test_rate_bounds_are_kpa_rates_around_the_ready_replicas(ready: int, max_down: int, max_up: int) -> None:
    bounds = RateBounds.of(scaling(max_scale_up_rate=10.0, max_scale_down_rate=2.0), ready)
    assert (bounds.max_down, bounds.max_up) == (max_down, max_up)


@pytest.mark.parametrize("wanted,bounded", [(1, 2), (5, 5), (50, 40)])
def test_a_count_is_held_within_the_rate_bounds(wanted: int, bounded: int) -> None:
    assert RateBounds(max_down=2, max_up=40).bound(wanted) == bounded


# ----------------------------------------------------------------------------------------- demand


def test_each_window_averages_its_own_samples() -> None:
    # Idle for 5 s, then 16 ongoing for 5 s; at t=9 the 6 s panic window holds t=4..9: 80 / 6 = 13.3
    # -> ceil(13.3 / 8) = 2; the stable window holds all ten: 80 / 10 = 8 -> 1.
    samples = tuple(Sample(float(t), 0.0 if t < 5 else 16.0, 0.0) for t in range(10))
    spec = ScalerSpec(scaling())
    demand = measure_demand(spec, samples, ForecastState(), RateBounds(0, 100), now=9.0)
    assert (demand.stable_conc, round(demand.panic_conc, 1)) == (8.0, 13.3)
    assert (demand.stable_desired, demand.panic_desired) == (1, 2)
    assert (demand.forecast_rps, demand.forecast_desired) == (None, 0)  # forecast off


@pytest.mark.parametrize("forecast_rps,level_rps,window_rps,expected", [
    (15.0, 10.0, 10.0, 30.0),  # 20 ongoing at 10 rps: 2 s in the system; 15 rps x 2 s = 30 ongoing
    (10.0, 10.0, 10.0, None),  # not rising: the stable window already says this
    (8.0, 10.0, 10.0, None),   # falling never adds replicas
    (15.0, None, 10.0, None),  # no level yet
    (None, 10.0, 10.0, None),  # no forecast yet
    (15.0, 10.0, 0.0, None),   # nothing arrived over the window: no time in system to scale by
])
def test_forecast_concurrency_is_littles_law_on_a_rising_trend(forecast_rps: float | None, level_rps: float | None,
                                                               window_rps: float, expected: float | None) -> None:
    samples = tuple(Sample(float(t), 20.0, window_rps) for t in range(5))
    assert forecast_concurrency(forecast_rps, level_rps, samples, stable_conc=20.0) == expected


# ------------------------------------------------------------------------------------- the panic clock


@pytest.mark.parametrize("previous,panic_desired,ready,warming,now,expected", [
    (None, 4, 2, False, 100.0, 100.0),  # 4 / 2 ready = 2 >= threshold 2: panic starts
    (None, 3, 2, False, 100.0, None),   # 1.5 < 2: calm
    (None, 2, 0, False, 100.0, 100.0),  # ready counts as at least 1: 2 / 1 >= 2
    (None, 10, 1, True, 100.0, None),   # warming up never crosses
    (100.0, 9, 3, False, 105.0, 105.0),  # crossing again extends the panic
    (100.0, 1, 3, False, 160.0, 100.0),  # 60 s without a crossing: not more than the stable window yet
    (100.0, 1, 3, False, 161.0, None),   # 61 s: the panic is over
])
def test_panic_starts_at_the_threshold_and_ends_a_stable_window_after_the_last_crossing(
        previous: float | None, panic_desired: int, ready: int, warming: bool, now: float,
        expected: float | None) -> None:
    s = scaling(panic_threshold=2.0, stable_window_s=60.0)
    assert next_panic_over_at(s, previous, panic_desired, ready, warming, now) == expected


# ------------------------------------------------------------------------------------------ delays


@pytest.mark.parametrize("state,proposal,desired,up_since,reason", [
    # Up delay 10 s: the first tick that wants 5 starts the clock and holds 3 ...
    (ScalerState(), 5, 3, 100.0, "hold 3: why; up delay 10s not over"),
    # ... and 10 s of wanting more later, it applies.
    (ScalerState(up_since=90.0), 5, 5, None, "scale up: why"),
    # Down delay 30 s: 3 was wanted 20 s ago (kept until 110 s), so wanting 2 now holds 3 ...
    (ScalerState(wanted=((110.0, 3),)), 2, 3, None, "hold 3: why; 3 wanted within the down delay 30s"),
    # ... until that is 30 s old: then down to the most still kept (2 from 65 s has gone too, 1 now -> 1) ...
    (ScalerState(wanted=((90.0, 3), (95.0, 2))), 1, 1, None, "scale down: why"),
    # ... or to a count kept above the proposal: 2 wanted at 85 s.
    (ScalerState(wanted=((90.0, 3), (115.0, 2))), 1, 2, None, "scale down: why; 2 wanted within 30s"),
    # Wanting what runs within a delay of the last tick wanting more keeps the up clock (a flicker is not a change
    # of mind); later, or wanting less, stops it.
    (ScalerState(up_since=95.0, up_last_at=98.0, wanted=((110.0, 3),)), 3, 3, 95.0, "steady: why"),
    (ScalerState(up_since=85.0, up_last_at=90.0, wanted=((110.0, 3),)), 3, 3, None, "steady: why"),
    (ScalerState(up_since=95.0, up_last_at=98.0, wanted=((110.0, 3),)), 2, 3, None,
     "hold 3: why; 3 wanted within the down delay 30s"),
])
def test_a_change_applies_once_it_was_wanted_for_its_delay(state: ScalerState, proposal: int, desired: int,
                                                           up_since: float | None, reason: str) -> None:
    s = scaling(scale_up_delay_s=10.0, scale_down_delay_s=30.0)
    step = apply_delays(s, state, proposal, current=3, now=100.0, why="why")
    assert (step.desired, step.reason, step.up_since) == (desired, reason, up_since)
    assert step.wanted[-1] == (130.0, proposal)  # this tick's count, kept for the delay


def test_the_down_window_keeps_the_rate_for_the_delay_and_a_backlog_briefly() -> None:
    # The work model proposes 6 with a backlog to drain and 4 for the arrivals alone: 4 is kept for the 300 s
    # delay, 6 for the 100 s a backlog's replicas get (two cold starts of 50 s).
    s = scaling(scale_down_delay_s=300.0)
    step = apply_delays(s, ScalerState(), 6, current=6, now=0.0, why="why", keep=4, keep_proposal_s=100.0)
    assert step.wanted == ((300.0, 4), (100.0, 6))
    state = replace(ScalerState(), wanted=step.wanted)
    assert apply_delays(s, state, 3, current=6, now=50.0, why="why").desired == 6  # the backlog's replicas stay
    assert apply_delays(s, state, 3, current=6, now=100.0, why="why").desired == 4  # then the rate's count


def test_the_window_keeps_each_count_until_a_later_one_outlasts_it() -> None:
    # The docstring's worked numbers: (300, 5), (400, 3), then 4 until 500 at 200.
    assert remember_wanted(((300.0, 5), (400.0, 3)), 4, 200.0, 500.0) == ((300.0, 5), (500.0, 4))
    assert remember_wanted(((300.0, 5), (500.0, 4)), 2, 350.0, 650.0) == ((500.0, 4), (650.0, 2))
    assert most_wanted(((300.0, 5), (500.0, 4))) == 5 and most_wanted(()) == 0


# ----------------------------------------------------------------------------------- to and from zero


@pytest.mark.parametrize("last_busy_at,now,desired,reason", [
    (100.0, 250.0, 1, "hold 1: idle 150s < scale_to_zero_grace 300s"),
    (100.0, 400.0, 0, "scale to zero: idle 300s >= grace 300s"),
    (None, 10.0, 0, "scale to zero: idle"),  # never busy since it started: idle for ever
])
def test_zero_waits_for_the_idle_grace(last_busy_at: float | None, now: float, desired: int, reason: str) -> None:
    s = scaling(min_replicas=0, scale_to_zero_grace_s=300.0)
    step = guard_scale_to_zero(s, Step(0, "steady"), current=2, last_busy_at=last_busy_at, now=now)
    assert step.desired == desired and step.reason.startswith(reason)


@pytest.mark.parametrize("min_replicas,current,desired", [
    (1, 2, 0),  # min_replicas 1: not this rule's business (the clamp raises it)
    (0, 0, 0),  # already at zero
    (0, 2, 3),  # not going to zero
])
def test_the_idle_grace_applies_only_on_the_way_to_zero(min_replicas: int, current: int, desired: int) -> None:
    step = Step(desired, "steady")
    assert guard_scale_to_zero(scaling(min_replicas=min_replicas), step, current, None, 100.0) is step


def test_a_waiting_request_wakes_a_model_at_zero_at_once() -> None:
    # 3 waiting; the windows ask for 2 (stable) and 4 (panic): the larger, with the delay clocks reset.
    demand = Demand(stable_conc=10.0, panic_conc=30.0, stable_desired=2, panic_desired=4)
    step = wake_from_zero(Step(0, "hold 0", up_since=5.0, wanted=((36.0, 1),)), 3, demand)
    assert step == Step(4, "scale from zero: 3 request(s) waiting", wanted=((36.0, 1),))


@pytest.mark.parametrize("desired,ongoing", [(0, 0), (1, 3)])
def test_nothing_waiting_or_a_replica_wanted_needs_no_wake_up(desired: int, ongoing: int) -> None:
    step = Step(desired, "steady")
    assert wake_from_zero(step, ongoing, Demand(0.0, 0.0, 0, 0)) is step


# -------------------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("wanted,clamped", [(0, 1), (7, 7), (60, 50)])
def test_the_count_is_clamped_to_min_and_max_replicas(wanted: int, clamped: int) -> None:
    assert within_limits(scaling(min_replicas=1, max_replicas=50), wanted) == clamped
