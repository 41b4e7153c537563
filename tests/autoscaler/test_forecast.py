"""The arrival-rate forecast: tracks a ramp's slope, ignores noise, handles irregular ticks."""

from __future__ import annotations

import math
import random

import pytest

from kvgate.autoscaler.forecast import ForecastSettings, ForecastState, forecast_rate, observe_rate


def feed(samples: list[tuple[float, float]], settings: ForecastSettings = ForecastSettings()) -> ForecastState:
    state = ForecastState()
    for t, x in samples:
        state = observe_rate(state, x, t, settings)
    return state


def test_no_data_no_forecast() -> None:
    assert forecast_rate(ForecastState(), 120.0) is None


@pytest.mark.parametrize("step_s", [1.0, 5.0])
def test_a_ramp_is_extrapolated_one_horizon_ahead(step_s: float) -> None:
    # arrivals = 2 + 0.05 t /s for 10 minutes; at t=600 the rate is 32, 120 s later 38.
    # Holt's trend converges to 0.05 and the level to 32, whatever the tick length.
    n = int(600 / step_s)
    state = feed([(i * step_s, 2 + 0.05 * i * step_s) for i in range(n + 1)])
    assert math.isclose(state.trend_rps_per_s, 0.05, rel_tol=0.02)
    assert math.isclose(forecast_rate(state, 120.0) or 0.0, 38.0, rel_tol=0.02)


def test_noisy_steady_rate_forecasts_the_level_not_a_noise_trend() -> None:
    # 9 /s with sd 1.5, 30 minutes: at every tick after the first minute the 120 s forecast stays
    # within 1.2 /s of 9 (the trend of the noise stays under 2 sigma of the one-step surprise).
    rng = random.Random(3)
    state = ForecastState()
    worst = 0.0
    for t in range(1800):
        state = observe_rate(state, max(0.0, rng.gauss(9.0, 1.5)), float(t))
        if t >= 60:
            worst = max(worst, abs((forecast_rate(state, 120.0) or 0.0) - 9.0))
    assert worst < 1.2, worst


def test_a_falling_ramp_never_forecasts_below_zero() -> None:
    # 10 /s falling by 0.1 /s each second, then 0: at t=140 (past the 120 s warm-up) the level is ~0 and
    # the trend negative: the forecast is 0, not below.
    state = feed([(float(t), max(0.0, 10 - 0.1 * t)) for t in range(140)])
    assert state.trend_rps_per_s < 0
    assert forecast_rate(state, 600.0) == 0.0


def test_the_trend_is_not_used_during_the_warm_up() -> None:
    # A ramp seen for 60 s: the trend is there but not yet trusted (2 x 60 s warm-up): forecast = level.
    state = feed([(float(t), 0.5 * t) for t in range(61)])
    assert state.trend_rps_per_s > 0
    assert forecast_rate(state, 120.0) == state.level_rps


@pytest.mark.parametrize("bad", [-5.0, float("nan"), float("inf")])
def test_bad_samples_read_as_zero(bad: float) -> None:
    state = feed([(0.0, 4.0), (1.0, bad)])
    assert state.level_rps is not None and 0.0 <= state.level_rps < 4.0


def test_a_repeated_timestamp_does_not_move_the_trend() -> None:
    state = feed([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)])
    again = observe_rate(state, 100.0, 2.0)
    assert again.trend_rps_per_s == state.trend_rps_per_s
