"""Synthetic traces in the shapes real fleets see, for judging autoscaling on traffic it was not tuned on.

Every shape is a non-homogeneous Poisson process (arrivals drawn by thinning against the shape's rate curve)
with request sizes from lognormals, seeded, so a shape and a seed always give the same trace:

  mmpp            bursty on/off: a two-state Markov-modulated Poisson process, on at 3x the mean rate and off
                  (idle) between, exponential sojourns of 120 s on and 240 s off on average
  diurnal         a day's sine compressed into the trace: the peak 4x the trough, two cycles an hour
  prefill-heavy   a steady rate of long prompts and short answers (median 2,000 tokens in, 30 out)
  decode-heavy    a steady rate of short prompts and long answers (median 200 tokens in, 600 out)
  ramp            the rate grows from a tenth of the mean to nearly twice it, steadily, over the trace
  flash-crowd     a steady base, then from a third of the way in a crowd at 8x it for 5 minutes, ebbing
                  over the next 5

`mean_rps` is the mean rate over the whole trace at scale 1 (`traces.scale_rate` multiplies it); sizes other
than the two mixes are the Azure conversation trace's medians (1,020 in, 129 out).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.autoscaler.sim.traces import Request, Trace, lognormal_tokens

AZURE_MEDIANS = (1020, 129)  # input, output tokens: the Azure conversation trace's medians


@dataclass(frozen=True)
class ShapeSpec:
    duration_s: float = 3600.0
    mean_rps: float = 4.0
    seed: int = 0


# A shape: its rate (requests/s) at each time, its peak (for thinning), and its size medians.
RateCurve = Callable[[float], float]


@dataclass(frozen=True)
class _Shape:
    curve: Callable[[ShapeSpec, random.Random], tuple[RateCurve, float]]  # (rate at t, the highest rate)
    medians: tuple[int, int] = AZURE_MEDIANS


def _steady(spec: ShapeSpec, rng: random.Random) -> tuple[RateCurve, float]:
    return (lambda t: spec.mean_rps), spec.mean_rps


def _mmpp(spec: ShapeSpec, rng: random.Random) -> tuple[RateCurve, float]:
    # On a third of the time on average (120 s on, 240 s off), at 3x the mean: the mean rate holds.
    on_rate, mean_on_s, mean_off_s = 3.0 * spec.mean_rps, 120.0, 240.0
    switches, t, on = [], 0.0, rng.random() < 1 / 3
    starts_on = on
    while t < spec.duration_s:
        t += rng.expovariate(1.0 / (mean_on_s if on else mean_off_s))
        switches.append(t)
        on = not on

    def rate(at: float) -> float:
        flips = bisect.bisect_right(switches, at)
        return on_rate if (flips % 2 == 0) == starts_on else 0.0
    return rate, on_rate


def _diurnal(spec: ShapeSpec, rng: random.Random) -> tuple[RateCurve, float]:
    # mean x (1 + 0.6 sin): peak 1.6x, trough 0.4x the mean (4x apart); a random phase.
    period_s, phase = 1800.0, rng.uniform(0, 2 * math.pi)
    return (lambda t: spec.mean_rps * (1 + 0.6 * math.sin(2 * math.pi * t / period_s + phase))), 1.6 * spec.mean_rps


def _ramp(spec: ShapeSpec, rng: random.Random) -> tuple[RateCurve, float]:
    low, high = 0.1 * spec.mean_rps, 1.9 * spec.mean_rps  # linear: the mean is (low + high) / 2
    return (lambda t: low + (high - low) * t / spec.duration_s), high


def _flash_crowd(spec: ShapeSpec, rng: random.Random) -> tuple[RateCurve, float]:
    # Base b for the whole trace, plus 7b for 300 s and a linear ebb over 300 s more: the crowd adds
    # 7b x 450 s of requests, so b = mean x duration / (duration + 3,150 s).
    start, hold_s, ebb_s = spec.duration_s / 3, 300.0, 300.0
    base = spec.mean_rps * spec.duration_s / (spec.duration_s + 7 * (hold_s + ebb_s / 2))

    def rate(t: float) -> float:
        into = t - start
        if into < 0 or into >= hold_s + ebb_s:
            return base
        return base + 7 * base * (1.0 if into < hold_s else 1 - (into - hold_s) / ebb_s)
    return rate, 8 * base


SHAPES: dict[str, _Shape] = {
    "mmpp": _Shape(_mmpp),
    "diurnal": _Shape(_diurnal),
    "prefill-heavy": _Shape(_steady, (2000, 30)),
    "decode-heavy": _Shape(_steady, (200, 600)),
    "ramp": _Shape(_ramp),
    "flash-crowd": _Shape(_flash_crowd),
}


def shaped_trace(name: str, spec: ShapeSpec = ShapeSpec()) -> Trace:
    """The trace of shape `name` (one of SHAPES); raises ValueError naming the shapes for another name."""
    shape = SHAPES.get(name)
    if shape is None:
        raise ValueError(f"no trace shape {name!r}; choose from {', '.join(SHAPES)}")
    rng = random.Random(f"{name}-{spec.seed}")
    rate, peak = shape.curve(spec, rng)
    requests: list[Request] = []
    t = 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= spec.duration_s:
            break
        if rng.random() * peak < rate(t):  # thinning: kept with probability rate(t) / peak
            requests.append(Request(t, lognormal_tokens(rng, shape.medians[0]),
                                    lognormal_tokens(rng, shape.medians[1])))
    return Trace(f"{name}-seed{spec.seed}", tuple(requests))
