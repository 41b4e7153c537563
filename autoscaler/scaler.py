"""The replica scaler: how many replicas each model should have, decided from queue depth.

Level 1 of the autoscaler (seconds). One pure function, `decide_replicas(spec, state, obs, now)`,
called once per tick per model by the live loop and by the simulator alike.

The rules, and where they come from:
- Demand is concurrency: requests queued at gateways + waiting at replicas + running. Desired replicas
  = ceil(average concurrency / target_ongoing_requests) (Knative KPA, Ray Serve's target ongoing
  requests). Two averages: the stable window (60 s) for normal decisions, the panic window (6 s) for
  bursts.
- Panic (KPA): when the panic-window desire reaches panic_threshold x the ready replicas, scale to the
  panic-window desire at once (no up delay) and never scale down while panicking; panic ends after a
  whole stable window without crossing the threshold.
- Rate bounds (KPA): one decision moves between floor(ready / max_scale_down_rate) and
  ceil(ready x max_scale_up_rate).
- Delays (Ray Serve, KPA's scale-down delay): a higher count applies after scale_up_delay_s of
  continuously wanting more; a lower count after scale_down_delay_s of continuously wanting less, and
  then to the highest count wanted during that delay, so one quiet moment never sheds replicas.
- Scale to zero (KPA): only with min_replicas 0, and only after scale_to_zero_grace_s with no request
  queued, running or arriving. 0 -> 1 happens at once when a request waits (the gateway holds it).
- Forecast: with scaling.forecast_enabled and a cold start > 0, the arrival rate one cold start ahead
  (autoscaler.forecast), turned into concurrency by Little's law (concurrency per arrival/s measured
  over the stable window), may raise the count, never lower it: replicas start before the load lands.

Pure: no clock reads, no I/O, no randomness; the state is a small frozen value the caller keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvgate.autoscaler.forecast import ForecastSettings, ForecastState, forecast_rate, observe_rate
from kvgate.registry.schema import ModelDoc, Scaling

# ceil(16.000000001 / 8) must be 2, not 3: float sums over a window drift in the last bits.
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class ModelObservation:
    """One model's load at one moment, summed over gateways and replicas."""

    model: str
    queued_at_gateways: int  # held at gateways with no replica to send to (scale-from-zero demand)
    waiting: int  # admitted by replicas, not yet running (their own queues)
    running: int  # being served
    arrivals_per_s: float  # new requests per second, for the forecast and Little's law
    ttft_p99_s: float | None  # shown with the decision; not a scaling input (concurrency already is)
    ready_replicas: int  # serving now
    starting_replicas: int  # asked for, not ready yet (node boot, model load)

    @property
    def ongoing(self) -> int:
        """The concurrency the scaler targets: queued + waiting + running."""
        return self.queued_at_gateways + self.waiting + self.running


@dataclass(frozen=True, slots=True)
class ScalerSpec:
    """What the scaler needs to know about one model: its scaling policy and its cold start.

    `cold_start_s` is node boot plus model load for the pool the model usually lands on; it is the
    forecast horizon (0 switches the forecast off, as does scaling.forecast_enabled false).
    """

    scaling: Scaling
    cold_start_s: float = 0.0
    forecast: ForecastSettings = ForecastSettings()

    @classmethod
    def of(cls, model: ModelDoc, cold_start_s: float = 0.0) -> ScalerSpec:
        return cls(scaling=model.spec.scaling, cold_start_s=cold_start_s)


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    ongoing: float
    arrivals_per_s: float


@dataclass(frozen=True, slots=True)
class ScalerState:
    """What the scaler remembers between ticks for one model. Start with `ScalerState()`.

    `samples` holds one entry per tick within the stable window (60 entries at 1 s ticks).
    """

    desired: int | None = None  # None: no decision yet, start from the replicas that exist
    samples: tuple[Sample, ...] = ()
    panic_over_at: float | None = None  # last time the panic threshold was crossed; None: calm
    panic_max: int = 0  # most replicas wanted during this panic (never scale down in panic)
    up_since: float | None = None  # wanting more continuously since
    down_since: float | None = None  # wanting fewer continuously since
    down_max: int = 0  # the highest count wanted since down_since
    last_busy_at: float | None = None  # last tick with a request queued, running or arriving
    forecast: ForecastState = field(default_factory=ForecastState)


@dataclass(frozen=True, slots=True)
class ReplicaDecision:
    """The scaler's answer for one model at one tick."""

    desired: int
    panic: bool
    forecast_rps: float | None  # arrivals/s expected one cold start ahead; None when not forecasting
    reason: str  # one line with the numbers behind the count, for the dashboard and the event log
    stable_desired: int = 0  # ceil(stable-window concurrency / target), after the rate bounds
    panic_desired: int = 0  # the same over the panic window
    forecast_desired: int = 0  # the same for the forecast concurrency (0 when not forecasting)


def _ceil_div(value: float, target: float) -> int:
    return max(0, math.ceil(value / target - _EPS))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def decide_replicas(spec: ScalerSpec, state: ScalerState, obs: ModelObservation,
                    now: float) -> tuple[ScalerState, ReplicaDecision]:
    """Decide one model's replica count at `now`; returns the new state and the decision.

    Contract: `desired` is always within [min_replicas, max_replicas]; it is never 0 while a request is
    queued, waiting or running; it never drops while panicking. Call once per tick with increasing
    `now` (a repeated `now` is harmless). Raises nothing for any observation with non-negative counts.
    """
    s = spec.scaling
    samples = tuple(x for x in state.samples if x.t > now - s.stable_window_s and x.t < now)
    samples += (Sample(now, float(obs.ongoing), max(0.0, obs.arrivals_per_s)),)
    fstate = observe_rate(state.forecast, obs.arrivals_per_s, now, spec.forecast)
    busy = obs.ongoing > 0 or obs.arrivals_per_s > 0
    last_busy_at = now if busy else state.last_busy_at
    current = state.desired if state.desired is not None else min(
        s.max_replicas, max(s.min_replicas, obs.ready_replicas + obs.starting_replicas))

    stable_conc = _mean([x.ongoing for x in samples])
    panic_conc = _mean([x.ongoing for x in samples if x.t > now - s.panic_window_s])
    # KPA's bounds are relative to ready pods, at least 1 so that 0 -> N is possible.
    ready = max(1, obs.ready_replicas)
    max_up = math.ceil(s.max_scale_up_rate * ready - _EPS)
    max_down = math.floor(obs.ready_replicas / s.max_scale_down_rate + _EPS)

    def bound(n: int) -> int:
        return min(max_up, max(max_down, n))

    stable_desired = bound(_ceil_div(stable_conc, s.target_ongoing_requests))
    panic_desired = bound(_ceil_div(panic_conc, s.target_ongoing_requests))

    forecast_rps: float | None = None
    forecast_desired = 0
    if s.forecast_enabled and spec.cold_start_s > 0:
        forecast_rps = forecast_rate(fstate, spec.cold_start_s, spec.forecast)
        mean_rps = _mean([x.arrivals_per_s for x in samples])
        # Only a significant rising trend adds replicas: the forecast's level alone is a noisier copy
        # of what the stable window already says, and counting it would flap on steady load.
        rising = forecast_rps is not None and fstate.level_rps is not None and forecast_rps > fstate.level_rps
        if rising and forecast_rps is not None and mean_rps > 0:
            # Little's law: concurrency = arrival rate x time in system; the window gives the latter.
            forecast_desired = bound(_ceil_div(forecast_rps * stable_conc / mean_rps, s.target_ongoing_requests))

    # Panic: KPA enters (and extends) when panic desire / ready >= threshold, leaves a stable window later.
    history_s = now - samples[0].t
    warming = history_s < s.panic_window_s
    over = not warming and panic_desired / ready >= s.panic_threshold
    panic_over_at = now if over else state.panic_over_at
    if panic_over_at is not None and not over and now - panic_over_at > s.stable_window_s:
        panic_over_at = None
    panic = panic_over_at is not None

    up_since, down_since, down_max = state.up_since, state.down_since, state.down_max
    if warming:
        # A fresh scaler (first start, or a restart that lost its state) has a window of one or two
        # samples: hold what exists until a panic window of data is in, rather than jump on noise.
        desired, panic_max = current, 0
        reason = f"warming up: {history_s:.0f}s of data < panic window {s.panic_window_s:g}s; hold {current}"
    elif panic:
        panic_max = max(state.panic_max if state.panic_over_at is not None else current, panic_desired, current)
        desired = panic_max
        reason = (f"panic: {panic_conc:.1f} ongoing over {s.panic_window_s:g}s / target "
                  f"{s.target_ongoing_requests:g} -> {panic_desired}, ready {obs.ready_replicas}; never down in panic")
        up_since = down_since = None
        down_max = 0
    else:
        panic_max = 0
        proposal = max(stable_desired, forecast_desired)
        why = (f"{stable_conc:.1f} ongoing over {s.stable_window_s:g}s / target {s.target_ongoing_requests:g}"
               f" -> {stable_desired}")
        if forecast_desired > stable_desired:
            why += f"; forecast {forecast_rps:.2f} rps in {spec.cold_start_s:g}s -> {forecast_desired}"
        desired = current
        if proposal > current:
            down_since, down_max = None, 0
            up_since = now if up_since is None else up_since
            if now - up_since >= s.scale_up_delay_s:
                desired, up_since = proposal, None
                reason = f"scale up: {why}"
            else:
                reason = f"hold {current}: {why}; up delay {s.scale_up_delay_s:g}s not over"
        elif proposal < current:
            up_since = None
            down_since = now if down_since is None else down_since
            down_max = max(down_max if state.down_since is not None else 0, proposal)
            if now - down_since >= s.scale_down_delay_s:
                desired, down_since, down_max = max(down_max, proposal), None, 0
                reason = f"scale down: {why}"
            else:
                reason = f"hold {current}: {why}; down delay {s.scale_down_delay_s:g}s not over"
        else:
            up_since = down_since = None
            down_max = 0
            reason = f"steady: {why}"

    # Scale to zero only after the idle grace; before it, keep one replica warm.
    if desired == 0 and current > 0 and s.min_replicas == 0:
        idle_s = math.inf if last_busy_at is None else now - last_busy_at
        if idle_s < s.scale_to_zero_grace_s:
            desired = 1
            reason = f"hold 1: idle {idle_s:.0f}s < scale_to_zero_grace {s.scale_to_zero_grace_s:g}s"
        else:
            reason = f"scale to zero: idle {idle_s:.0f}s >= grace {s.scale_to_zero_grace_s:g}s"
    # 0 -> 1 at once when a request waits: no window, no delay (the gateway is holding it).
    if desired == 0 and obs.ongoing > 0:
        desired = max(1, stable_desired, panic_desired)
        up_since = down_since = None
        reason = f"scale from zero: {obs.ongoing} request(s) waiting"

    clamped = min(s.max_replicas, max(s.min_replicas, desired))
    if clamped != desired:
        reason += f"; clamped to [{s.min_replicas}, {s.max_replicas}]"
    new_state = replace(state, desired=clamped, samples=samples, panic_over_at=panic_over_at,
                        panic_max=panic_max, up_since=up_since, down_since=down_since, down_max=down_max,
                        last_busy_at=last_busy_at, forecast=fstate)
    return new_state, ReplicaDecision(desired=clamped, panic=panic, forecast_rps=forecast_rps, reason=reason,
                                      stable_desired=stable_desired, panic_desired=panic_desired,
                                      forecast_desired=forecast_desired)
