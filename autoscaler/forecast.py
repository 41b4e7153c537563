"""A trend-following forecast of a model's arrival rate: what the load will be one cold start from now.

Holt's linear exponential smoothing (level + trend), adapted to samples at irregular times: each sample
moves the level and the trend by a weight `1 - exp(-dt / tau)`, so a tick every 1 s and a tick every
5 s smooth over the same seconds, not the same number of samples. On a linear ramp the level tracks the
ramp with no steady lag and the trend converges to its slope, so `forecast_rate(state, h)` is the rate
`h` seconds ahead; on noisy steady load the trend hovers near zero (it is smoothed over
`trend_time_constant_s`, a minute by default).

Pure: no clock reads, no I/O; `now` and the samples are arguments and the state is a frozen value.
Not done: a seasonal (daily) component; the trend term covers the minutes-ahead horizon a cold start needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ForecastSettings:
    """Smoothing time constants, in seconds. Longer: steadier, slower to notice a ramp."""

    level_time_constant_s: float = 15.0
    trend_time_constant_s: float = 60.0
    # The trend counts only when its extrapolation beats this many standard deviations of the
    # one-step surprise (sample minus prediction): on noisy steady load the smoothed slope is never
    # exactly 0, and 120 s of a noise slope would add a replica now and remove it 30 s later.
    min_trend_sigmas: float = 2.0


@dataclass(frozen=True, slots=True)
class ForecastState:
    """The smoothed arrival rate (requests/s), its slope (requests/s per s) and when it was last fed.

    `level_rps` is None until the first sample: no forecast from no data.
    """

    level_rps: float | None = None
    trend_rps_per_s: float = 0.0
    updated_at: float | None = None
    surprise_var: float = 0.0  # smoothed variance of (sample - prediction), (requests/s)^2
    first_at: float | None = None  # first sample: the trend is not trusted before two trend time constants


def observe_rate(state: ForecastState, arrivals_per_s: float, now: float,
                 settings: ForecastSettings = ForecastSettings()) -> ForecastState:
    """Feed one arrival-rate sample taken at `now`; returns the new state.

    A sample at or before the last one (a clock that did not move, or a replayed tick) is ignored:
    a slope over 0 s means nothing. Negative or non-finite rates are
    read as 0 (a counter reset at a gateway must not produce a negative forecast).
    """
    x = arrivals_per_s if math.isfinite(arrivals_per_s) and arrivals_per_s > 0 else 0.0
    if state.level_rps is None or state.updated_at is None:
        return ForecastState(level_rps=x, trend_rps_per_s=0.0, updated_at=now, surprise_var=0.0, first_at=now)
    dt = now - state.updated_at
    if dt <= 0:
        return state
    alpha = 1.0 - math.exp(-dt / settings.level_time_constant_s)
    beta = 1.0 - math.exp(-dt / settings.trend_time_constant_s)
    predicted = state.level_rps + state.trend_rps_per_s * dt
    level = alpha * x + (1.0 - alpha) * predicted
    trend = beta * (level - state.level_rps) / dt + (1.0 - beta) * state.trend_rps_per_s
    surprise_var = beta * (x - predicted) ** 2 + (1.0 - beta) * state.surprise_var
    return ForecastState(level_rps=level, trend_rps_per_s=trend, updated_at=now, surprise_var=surprise_var,
                         first_at=state.first_at)


def forecast_rate(state: ForecastState, horizon_s: float,
                  settings: ForecastSettings = ForecastSettings()) -> float | None:
    """The arrival rate expected `horizon_s` seconds after the last sample (>= 0), or None with no data.

    Worked numbers: level 10 rps, trend +0.05 rps/s, horizon 120 s -> 10 + 0.05 x 120 = 16 rps, when
    the samples' surprise deviation is below 6 / 2 = 3 rps; with noisier samples the trend is noise
    and the forecast is the level, 10 rps. So it is for the first 2 x `trend_time_constant_s` of data,
    while the trend still carries the jump from 0 to the first level (e^-2: 14 % of it is left then).
    """
    if state.level_rps is None:
        return None
    gain = state.trend_rps_per_s * max(0.0, horizon_s)
    warming = (state.first_at is None or state.updated_at is None
               or state.updated_at - state.first_at < 2.0 * settings.trend_time_constant_s)
    if warming or abs(gain) < settings.min_trend_sigmas * math.sqrt(state.surprise_var):
        gain = 0.0
    return max(0.0, state.level_rps + gain)
