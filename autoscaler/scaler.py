"""The replica scaler: how many replicas each model should have, decided from its work and queue depth.

Level 1 of the autoscaler (seconds). One pure function, `decide_replicas(spec, state, obs, now)`,
called once per tick per model by the live loop and by the simulator alike. It runs the steps below
in order, each a pure function of its own so that it can be read and tested alone: the window and its
demand (`autoscaler.demand`: `measure_demand`, `RateBounds`), the panic clock (`next_panic_over_at`),
the mode (`hold_while_warming`, `follow_panic`, `follow_stable` with `apply_delays`), scale to and from
zero (`guard_scale_to_zero`, `wake_from_zero`) and the min/max clamp (`within_limits`).

The rules, and where they come from:
- Work (a model with a TTFT SLO and performance figures; `autoscaler.work` has the queueing model): the
  fewest replicas whose prefill and batch slots keep the SLO's attainment for the rate planned for, the
  current rate plus its drift over a cold start plus the backlog to drain (`work_demand`). Once a request's
  time in service is learned (`learn_hold`) this count replaces the concurrency target below out of panic,
  and a backlog counts as work to finish within a cold start rather than as load that stays
  (`backlog_concurrency`).
- Otherwise demand is concurrency: requests queued at gateways + waiting at replicas + running. Desired replicas
  = ceil(average concurrency / target_ongoing_requests) (Knative KPA, Ray Serve's target ongoing
  requests). Two averages: the stable window (60 s) for normal decisions, the panic window (6 s) for
  bursts.
- Panic (KPA): when the panic-window desire reaches panic_threshold x the ready replicas, scale to the
  panic-window desire at once (no up delay) and never scale down while panicking; panic ends after a
  whole stable window without crossing the threshold.
- Rate bounds (KPA): one decision moves between floor(ready / max_scale_down_rate) and
  ceil(ready x max_scale_up_rate).
- Delays (Ray Serve's up delay, KPA's scale-down delay): a higher count applies after scale_up_delay_s of
  continuously wanting more; a lower count is never below the most wanted over the last scale_down_delay_s,
  so one quiet moment never sheds replicas (with the work model, the most wanted for the arrival rate: a
  drained backlog is not load that comes back).
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

from kvgate.autoscaler.demand import (HOLD_WINDOWS, Demand, ModelObservation, RateBounds, Sample, ScalerSpec,
                                      arrival_dispersion, learn_hold, measure_demand, rate_keep_s, window_samples)
from kvgate.autoscaler.forecast import ForecastState, observe_rate
from kvgate.autoscaler.work import LittleLaw, PromptSpread, RateDrift
from kvgate.registry.schema import Scaling


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
    up_last_at: float | None = None  # the last tick that wanted more (a steady tick keeps up_since a delay past it)
    wanted: tuple[tuple[float, int], ...] = ()  # (until, count): counts still kept (`remember_wanted`)
    last_busy_at: float | None = None  # last tick with a request queued, running or arriving
    forecast: ForecastState = field(default_factory=ForecastState)
    prompts: PromptSpread = field(default_factory=PromptSpread)  # prompt sizes' spread over minutes (work model)
    hold: LittleLaw = field(default_factory=lambda: LittleLaw())  # a request's time in service (`learn_hold`)
    drift: RateDrift = field(default_factory=RateDrift)  # how far the rate moves over a cold start (work model)
    slots_sized: bool = False  # the last tick's count came from the work model's slots (a learned hold)


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
    work_desired: int = 0  # replicas whose prefill and slots keep the SLO for the work (0 without figures)


# -- the pure steps of one decision, in the order decide_replicas runs them ----------------------------


def next_panic_over_at(scaling: Scaling, panic_over_at: float | None, panic_desired: int, ready_replicas: int,
                       warming: bool, now: float) -> float | None:
    """When the panic threshold was last crossed; None when calm (KPA).

    Panic is entered (and extended) when panic desire / ready (at least 1) >= panic_threshold, and left
    once a whole stable window passed without a crossing. A scaler still warming up never crosses.
    """
    over = not warming and panic_desired / max(1, ready_replicas) >= scaling.panic_threshold
    if over:
        return now
    if panic_over_at is not None and now - panic_over_at > scaling.stable_window_s:
        return None
    return panic_over_at


@dataclass(frozen=True, slots=True)
class Step:
    """One tick's count before the min/max clamp, why, and the timers it leaves for the next tick."""

    desired: int
    reason: str
    panic_max: int = 0  # most replicas wanted during this panic
    up_since: float | None = None  # wanting more continuously since
    up_last_at: float | None = None  # the last tick that wanted more (a steady tick keeps up_since a delay past it)
    wanted: tuple[tuple[float, int], ...] = ()  # (until, count): counts still kept (`remember_wanted`)


def remember_wanted(wanted: tuple[tuple[float, int], ...], count: int, now: float,
                    until: float) -> tuple[tuple[float, int], ...]:
    """The counts still kept at `now`, with `count` kept until `until`: each (until, count) stays while its time is
    not over and no entry added since keeps as many for as long; the most of them is the floor a scale-down stops
    at. Worked: at 200, (300, 5), (400, 3) and 4 until 500 -> (300, 5), (500, 4); at 350, 2 until 650 -> (500, 4),
    (650, 2)."""
    kept = tuple((u, c) for u, c in wanted if u > now and not (c <= count and u <= until))
    return kept + ((until, count),)


def keep_wanted(wanted: tuple[tuple[float, int], ...], count: int, now: float, keep_s: float, *,
                rate_count: int | None = None, count_s: float = 0.0) -> tuple[tuple[float, int], ...]:
    """`wanted` with this tick's count kept for `keep_s`; with the work model, `rate_count` (the count for the
    arrival rate alone) kept for `keep_s` instead and `count`, where a backlog raises it above that, for `count_s`."""
    wanted = remember_wanted(wanted, count if rate_count is None else rate_count, now, now + keep_s)
    if rate_count is not None and count > rate_count:
        wanted = remember_wanted(wanted, count, now, now + count_s)
    return wanted


def most_wanted(wanted: tuple[tuple[float, int], ...]) -> int:
    return max((c for _, c in wanted), default=0)


def hold_while_warming(scaling: Scaling, state: ScalerState, current: int, history_s: float, now: float,
                       keep_s: float) -> Step:
    """A fresh scaler (first start, or a restart that lost its state) has a window of one or two
    samples: hold what exists until a panic window of data is in, rather than jump on noise. What exists
    counts as wanted, so it is also kept for the scale-down delay, as a scaler that had been running would
    (remembering nothing, a restarted autoscaler shed 9 of 13 replicas of steady traffic at its seventh second)."""
    return Step(current, f"warming up: {history_s:.0f}s of data < panic window {scaling.panic_window_s:g}s; "
                         f"hold {current}", up_since=state.up_since, up_last_at=state.up_last_at,
                wanted=remember_wanted(state.wanted, current, now, now + keep_s))


def follow_panic(spec: ScalerSpec, state: ScalerState, demand: Demand, current: int, ready_replicas: int,
                 now: float) -> Step:
    """In panic: the panic-window count at once (no up delay), never lower than the most wanted during
    this panic nor than `current`. The up delay's clock restarts; the scale-down delay remembers the panic's
    count, or with the work model the count for the arrival rate alone (`Demand.work_keep`) for the delay and the
    panic's count for two cold starts (`backlog_keep_s`): the replicas a backlog asked for go once they have had
    time to drain it, not a scale-down delay later."""
    s = spec.scaling
    held = state.panic_max if state.panic_over_at is not None else current
    panic_max = max(held, demand.panic_desired, demand.work_desired, current)
    yardstick = (f"max_batch {spec.capacity.max_batch}" if demand.work_sizes_slots and spec.capacity is not None
                 else f"target {s.target_ongoing_requests:g}")
    if demand.work_sizes_slots:
        wanted = keep_wanted(state.wanted, panic_max, now, rate_keep_s(spec), rate_count=demand.work_keep,
                             count_s=backlog_keep_s(spec))
    else:
        wanted = keep_wanted(state.wanted, panic_max, now, s.scale_down_delay_s)
    return Step(panic_max, f"panic: {demand.panic_conc:.1f} ongoing over {s.panic_window_s:g}s / {yardstick} -> "
                           f"{demand.panic_desired}, ready {ready_replicas}; never down in panic",
                panic_max=panic_max, wanted=wanted)


def backlog_keep_s(spec: ScalerSpec) -> float:
    """How long replicas asked for to drain a backlog are kept: one cold start to arrive, one to drain it
    (`backlog_drain_rps` plans the drain over a cold start). Dropped as soon as the backlog cleared, they were
    cancelled while still starting, and on a steady ramp the fleet stayed one cold start short: 8 replicas ready for
    minutes while 12 were asked for, and 40% of a minute's requests missed the SLO."""
    return 2.0 * max(spec.cold_start_s, spec.scaling.panic_window_s)


def follow_stable(spec: ScalerSpec, state: ScalerState, demand: Demand, current: int, now: float) -> Step:
    """Out of panic: the stable-window count, raised by the forecast, after the up or down delay. Once the work
    model sizes the slots too (`Demand.work_sizes_slots`) its count replaces the concurrency target's (the
    forecast rate is already in it), and the scale-down delay remembers it without the backlog; the target stays
    the panic's yardstick where the work model has no figures."""
    s = spec.scaling
    if demand.work_sizes_slots:
        return apply_delays(s, state, demand.work_desired, current, now, demand.work_why, keep=demand.work_keep,
                            keep_proposal_s=backlog_keep_s(spec), keep_s=rate_keep_s(spec))
    why = (f"{demand.stable_conc:.1f} ongoing over {s.stable_window_s:g}s / target {s.target_ongoing_requests:g}"
           f" -> {demand.stable_desired}")
    if demand.forecast_desired > demand.stable_desired:
        why += f"; forecast {demand.forecast_rps:.2f} rps in {spec.cold_start_s:g}s -> {demand.forecast_desired}"
    if demand.work_desired > max(demand.stable_desired, demand.forecast_desired):
        why += f"; {demand.work_why}"
    proposal = max(demand.stable_desired, demand.forecast_desired, demand.work_desired)
    return apply_delays(s, state, proposal, current, now, why)


def apply_delays(scaling: Scaling, state: ScalerState, proposal: int, current: int, now: float, why: str,
                 keep: int | None = None, keep_proposal_s: float = 0.0, keep_s: float | None = None) -> Step:
    """Move from `current` to `proposal` only once it has been wanted long enough (Ray Serve, KPA).

    Up: after scale_up_delay_s of continuously wanting more (a tick wanting what runs within a delay of the last one
    wanting more does not restart the clock: on the Azure trace the work model's count flickered between 15 and
    16-18 for minutes, every 15 restarted it, and the fleet stayed at 15 while 520 requests sought its 480 slots).
    Down: never below the most wanted over the last scale_down_delay_s (KPA's scale-down delay, a sliding window's
    maximum), so one quiet moment never sheds replicas and a fleet follows a falling load one delay behind. What the
    window remembers for `keep_s` (default: the delay) is `keep` (default: the proposal); a proposal above it is kept
    for `keep_proposal_s`.

    The window used to start when the count first fell and then drop to the most wanted since: after a long
    fall, every step down waited a whole delay again, and on the diurnal shape the fleet held its peak of 5 for
    ten minutes after the load had fallen to what 3 served, and 4 for ten more.
    """
    delay_s = scaling.scale_down_delay_s if keep_s is None else keep_s
    wanted = keep_wanted(state.wanted, proposal, now, delay_s, rate_count=keep, count_s=keep_proposal_s)
    held = most_wanted(wanted)
    if proposal > current:
        up_since = now if state.up_since is None else state.up_since
        if now - up_since >= scaling.scale_up_delay_s:
            return Step(proposal, f"scale up: {why}", wanted=wanted)
        return Step(current, f"hold {current}: {why}; up delay {scaling.scale_up_delay_s:g}s not over",
                    up_since=up_since, up_last_at=now, wanted=wanted)
    if proposal < current:
        floor = min(current, max(proposal, held))
        if floor < current:
            since = f"; {floor} wanted within {delay_s:g}s" if floor > proposal else ""
            return Step(floor, f"scale down: {why}{since}", wanted=wanted)
        return Step(current, f"hold {current}: {why}; {held} wanted within the down delay "
                             f"{delay_s:g}s", wanted=wanted)
    if state.up_last_at is not None and now - state.up_last_at < scaling.scale_up_delay_s:
        return Step(current, f"steady: {why}", up_since=state.up_since, up_last_at=state.up_last_at, wanted=wanted)
    return Step(current, f"steady: {why}", wanted=wanted)


def guard_scale_to_zero(scaling: Scaling, step: Step, current: int, last_busy_at: float | None,
                        now: float) -> Step:
    """Going to zero (min_replicas 0 only) waits for scale_to_zero_grace_s of idleness; before it,
    one replica stays warm."""
    if step.desired != 0 or current <= 0 or scaling.min_replicas != 0:
        return step
    idle_s = math.inf if last_busy_at is None else now - last_busy_at
    if idle_s < scaling.scale_to_zero_grace_s:
        return replace(step, desired=1, reason=f"hold 1: idle {idle_s:.0f}s < scale_to_zero_grace "
                                               f"{scaling.scale_to_zero_grace_s:g}s")
    return replace(step, reason=f"scale to zero: idle {idle_s:.0f}s >= grace {scaling.scale_to_zero_grace_s:g}s")


def wake_from_zero(step: Step, ongoing: int, demand: Demand) -> Step:
    """0 -> 1 (or more) at once when a request waits: no window, no delay (the gateway is holding it)."""
    if step.desired != 0 or ongoing <= 0:
        return step
    return replace(step, desired=max(1, demand.stable_desired, demand.panic_desired, demand.work_desired),
                   up_since=None, reason=f"scale from zero: {ongoing} request(s) waiting")


def within_limits(scaling: Scaling, replicas: int) -> int:
    """`replicas` clamped to [min_replicas, max_replicas]."""
    return min(scaling.max_replicas, max(scaling.min_replicas, replicas))


def decide_replicas(spec: ScalerSpec, state: ScalerState, obs: ModelObservation,
                    now: float) -> tuple[ScalerState, ReplicaDecision]:
    """Decide one model's replica count at `now`; returns the new state and the decision.

    Contract: `desired` is always within [min_replicas, max_replicas]; it is never 0 while a request is
    queued, waiting or running; it never drops while panicking. Call once per tick with increasing
    `now` (a repeated `now` is harmless). Raises nothing for any observation with non-negative counts.
    """
    s = spec.scaling
    samples = window_samples(state.samples, obs, now, s.stable_window_s)
    fstate = observe_rate(state.forecast, obs.arrivals_per_s, now, spec.forecast)
    prompts = state.prompts.add(obs.arrivals_per_s, obs.prompt_tokens_per_s, obs.prompt_tokens_sq_per_s, now)
    hold = learn_hold(state.hold, obs, samples, now, HOLD_WINDOWS * s.stable_window_s)
    hold_s = hold.settled_hold_s(now)
    history_s = now - samples[0].t
    warming = history_s < s.panic_window_s
    # A gateway's first rates cover less than its window (0 before its second sample): a fresh scaler's first
    # seconds would pass for a rise of the whole load, and the scale-down delay would keep that for minutes.
    # The drift is measured on the stable window's mean rate, its sampling noise taken out (`RateDrift`), over a
    # cold start plus the half window that mean lags behind the rate now.
    stable_rps = sum(x.arrivals_per_s for x in samples) / len(samples)  # never empty: this tick's is in
    horizon_s = spec.cold_start_s + s.stable_window_s / 2
    # Two means a horizon apart share samples when it is shorter than the window: less noise in their difference.
    overlap = min(1.0, horizon_s / s.stable_window_s)
    noise_per_rps = arrival_dispersion(samples, stable_rps) / s.stable_window_s * overlap
    drift = (state.drift.add(stable_rps, now, horizon_s, noise_per_rps=noise_per_rps)
             if spec.capacity is not None and not warming else state.drift)
    last_busy_at = now if obs.ongoing > 0 or obs.arrivals_per_s > 0 else state.last_busy_at
    current = state.desired if state.desired is not None else within_limits(
        s, obs.ready_replicas + obs.starting_replicas)
    demand = measure_demand(spec, samples, fstate, RateBounds.of(s, obs.ready_replicas), now, prompts, hold_s,
                            drift.sigma(), hold.prompt_tokens_per_replica_s)

    if demand.work_sizes_slots and not state.slots_sized:
        # Counts made before the hold was learned are the target's guess (half a batch a replica) or the panic's:
        # kept like a backlog's, two cold starts, not the delay. Kept the delay, the 28 replicas a fresh scaler
        # guessed for steady decode-heavy traffic stayed ten minutes where the learned hold asked for 17.
        cap = now + backlog_keep_s(spec)
        state = replace(state, wanted=tuple((min(u, cap), c) for u, c in state.wanted))
    panic_over_at = next_panic_over_at(s, state.panic_over_at, demand.panic_desired, obs.ready_replicas,
                                       warming, now)
    if warming:
        keep_s = rate_keep_s(spec) if spec.capacity is not None else s.scale_down_delay_s
        step = hold_while_warming(s, state, current, history_s, now, keep_s)
    elif panic_over_at is not None:
        step = follow_panic(spec, state, demand, current, obs.ready_replicas, now)
    else:
        step = follow_stable(spec, state, demand, current, now)
    step = wake_from_zero(guard_scale_to_zero(s, step, current, last_busy_at, now), obs.ongoing, demand)

    clamped, reason = within_limits(s, step.desired), step.reason
    if clamped != step.desired:
        reason += f"; clamped to [{s.min_replicas}, {s.max_replicas}]"
    new_state = replace(state, desired=clamped, samples=samples, panic_over_at=panic_over_at,
                        panic_max=step.panic_max, up_since=step.up_since, up_last_at=step.up_last_at,
                        wanted=step.wanted,
                        last_busy_at=last_busy_at, forecast=fstate, prompts=prompts, hold=hold, drift=drift,
                        slots_sized=demand.work_sizes_slots)
    return new_state, ReplicaDecision(desired=clamped, panic=panic_over_at is not None,
                                      forecast_rps=demand.forecast_rps, reason=reason,
                                      stable_desired=demand.stable_desired, panic_desired=demand.panic_desired,
                                      forecast_desired=demand.forecast_desired, work_desired=demand.work_desired)
