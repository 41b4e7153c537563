"""The replica scaler: how many replicas each model should have, decided from its work and queue depth.

Level 1 of the autoscaler (seconds). One pure function, `decide_replicas(spec, state, obs, now)`,
called once per tick per model by the live loop and by the simulator alike. It runs the steps below
in order, each a pure function of its own so that it can be read and tested alone: the window and its
demand (`measure_demand`, `RateBounds`, `forecast_concurrency`), the panic clock (`next_panic_over_at`),
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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from kvgate.autoscaler.forecast import ForecastSettings, ForecastState, forecast_rate, observe_rate
from kvgate.autoscaler.work import (DRIFT_SIGMAS, LittleLaw, PromptLoad, PromptSpread, RateDrift, ReplicaCapacity,
                                    SlotHold, miss_budget, prefill_replicas, slot_replicas, ttft_miss)
from kvgate.registry.schema import ModelDoc, Scaling

_UNIT = NormalDist()
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
    prompt_tokens_per_s: float = 0.0  # prompt tokens arriving per second, less those predicted cached (same window)
    prompt_tokens_sq_per_s: float = 0.0  # the sum of each prompt's tokens squared, per second: their spread
    arrivals_var: float | None = None  # variance of the arrivals counted in each second of the window; None: unknown
    completions_per_s: float | None = None  # requests finished at replicas per second (same window); None: unknown

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
    capacity: ReplicaCapacity | None = None  # None: no SLO or no performance figures, concurrency alone

    @classmethod
    def of(cls, model: ModelDoc, cold_start_s: float = 0.0) -> ScalerSpec:
        return cls(scaling=model.spec.scaling, cold_start_s=cold_start_s, capacity=ReplicaCapacity.of(model))


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    ongoing: float
    arrivals_per_s: float
    prompt_tokens_per_s: float = 0.0
    arrivals_var: float | None = None
    queued: float = 0.0  # the part of `ongoing` not yet running: held at gateways or waiting at replicas


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


def _ceil_div(value: float, target: float) -> int:
    return max(0, math.ceil(value / target - _EPS))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# -- the pure steps of one decision, in the order decide_replicas runs them ----------------------------


@dataclass(frozen=True, slots=True)
class RateBounds:
    """How far one decision may move (KPA): between floor(ready / max_scale_down_rate) and
    ceil(ready x max_scale_up_rate), the up bound counted on at least 1 ready so that 0 -> N is possible.

    Worked numbers: 4 ready, rates 10 and 2 -> [2, 40]; 0 ready -> [0, 10]."""

    max_down: int
    max_up: int

    @classmethod
    def of(cls, scaling: Scaling, ready_replicas: int) -> RateBounds:
        return cls(max_down=math.floor(ready_replicas / scaling.max_scale_down_rate + _EPS),
                   max_up=math.ceil(scaling.max_scale_up_rate * max(1, ready_replicas) - _EPS))

    def bound(self, replicas: int) -> int:
        return min(self.max_up, max(self.max_down, replicas))


@dataclass(frozen=True, slots=True)
class Demand:
    """What one tick's windows ask for: the concurrency they average and the replicas it needs (each
    count ceil(concurrency / target), within the rate bounds)."""

    stable_conc: float  # mean ongoing requests over the stable window
    panic_conc: float  # the same over the panic window
    stable_desired: int
    panic_desired: int
    forecast_rps: float | None = None  # arrivals/s expected one cold start ahead; None when not forecasting
    forecast_desired: int = 0  # replicas for the forecast concurrency; 0 unless the trend is rising
    work_desired: int = 0  # replicas whose prefill meets the TTFT SLO for the prompt load (`autoscaler.work`)
    work_keep: int = 0  # the same without the backlog to drain: what the scale-down delay remembers
    work_why: str = ""  # the numbers behind work_desired, for the reason line
    work_sizes_slots: bool = False  # work_desired covers the batch slots too: it replaces the concurrency target


def window_samples(samples: tuple[Sample, ...], obs: ModelObservation, now: float,
                   stable_window_s: float) -> tuple[Sample, ...]:
    """The samples still inside the stable window (older than `now`), plus this tick's."""
    kept = tuple(x for x in samples if x.t > now - stable_window_s and x.t < now)
    return kept + (Sample(now, float(obs.ongoing), max(0.0, obs.arrivals_per_s), max(0.0, obs.prompt_tokens_per_s),
                          obs.arrivals_var,
                          float(obs.queued_at_gateways + obs.waiting)),)


def measure_demand(spec: ScalerSpec, samples: tuple[Sample, ...], fstate: ForecastState, bounds: RateBounds,
                   now: float, prompts: PromptSpread = PromptSpread(), hold_s: float | None = None,
                   drift_rps: float = 0.0, learned_prefill_per_replica_s: float = 0.0) -> Demand:
    """Average the windows and turn them (and the forecast, when on) into replica counts."""
    s = spec.scaling
    recent = [x for x in samples if x.t > now - s.panic_window_s]
    stable_conc = _mean([x.ongoing - x.queued for x in samples]) + backlog_concurrency(spec, samples, hold_s)
    panic_conc = _mean([x.ongoing - x.queued for x in recent]) + backlog_concurrency(spec, recent, hold_s)
    demand = Demand(stable_conc=stable_conc, panic_conc=panic_conc,
                    stable_desired=bounds.bound(_ceil_div(stable_conc, s.target_ongoing_requests)),
                    panic_desired=bounds.bound(_ceil_div(panic_conc, s.target_ongoing_requests)))
    if s.forecast_enabled and spec.cold_start_s > 0:
        forecast_rps = forecast_rate(fstate, spec.cold_start_s, spec.forecast)
        conc = forecast_concurrency(forecast_rps, fstate.level_rps, samples, stable_conc)
        forecast_desired = 0 if conc is None else bounds.bound(_ceil_div(conc, s.target_ongoing_requests))
        demand = replace(demand, forecast_rps=forecast_rps, forecast_desired=forecast_desired)
    if spec.capacity is not None:
        work_desired, work_keep, work_why = work_demand(spec.capacity, samples, prompts.c_s2, hold_s,
                                                        demand.forecast_rps, s, spec.cold_start_s, now, drift_rps,
                                                        learned_prefill_per_replica_s, rate_keep_s(spec))
        sizes_slots = hold_s is not None and spec.capacity.max_batch > 0
        demand = replace(demand, work_desired=bounds.bound(work_desired), work_keep=bounds.bound(work_keep),
                         work_why=work_why, work_sizes_slots=sizes_slots)
        if sizes_slots:
            # A replica holds its whole batch, not the target's share of it: panic counts concurrency against
            # `max_batch` once the work model sizes the slots (the target of 16 a replica read a full batch of 32
            # as twice the fleet, and a flash of mmpp traffic panicked from 10 replicas to 20).
            demand = replace(demand, panic_desired=bounds.bound(_ceil_div(panic_conc, spec.capacity.max_batch)))
    return demand


def learn_hold(hold: LittleLaw, obs: ModelObservation, samples: Sequence[Sample], now: float) -> LittleLaw:
    """`hold` with this tick's running and completions added: Little's law over the replicas alone, which holds at
    every tick, a backlog waiting at the gateways or not. Idle ticks (nothing running or finishing) count: they are
    part of the averages. Worked: 60 running, 12 finishing a second -> 5 s.

    From gateways that report no completions, arrivals stand in for them, which holds only with nothing queued now
    nor in the window's samples: under a backlog running is the batch's cap and arrivals outrun completions; just
    after one, the backlog's requests are still in service. Learning only then, a fleet short of slots (a queue most
    ticks) kept the short hold it learned while its load first rose (16 s for 23 on decode-heavy traffic in the
    simulator) and was sized on it, short again."""
    per_replica = obs.prompt_tokens_per_s / max(1, obs.ready_replicas)
    if obs.completions_per_s is not None:
        return hold.add(obs.running, obs.completions_per_s, now, prompt_tokens_per_replica_s=per_replica)
    if obs.queued_at_gateways + obs.waiting > 0 or any(x.queued > 0 for x in samples):
        return hold
    return hold.add(obs.running, obs.arrivals_per_s, now, prompt_tokens_per_replica_s=per_replica)


def backlog_concurrency(spec: ScalerSpec, samples: Sequence[Sample], hold_s: float | None) -> float:
    """The concurrency a backlog stands for, over `samples`: each queued request as one (KPA's rule) without the
    work model or a learned hold time.

    With them, a backlog is work to finish within one cold start, not load that stays: drained at
    `backlog_drain_rps` more requests a second, each holding a slot for its time in service h, it needs that
    rate x h slots. Until h is learned (a first start, from zero) the prefill term alone counts the backlog:
    under a backlog, running over arrivals overstates h (a fleet just filled from the queue read 15 s for
    5). Counting each queued request as a whole slot, as KPA does, turned a 50 s wait from zero
    at 12 requests/s (569 queued, about 5 s each in service) into 30 replicas where 4 served it, then held
    for the scale-down delay. Worked: 500 queued and steady, h 5 s, L 50 s -> 10 rps x 5 s = 50.
    """
    if spec.capacity is None or spec.cold_start_s <= 0:
        return _mean([x.queued for x in samples])
    if hold_s is None:  # nothing learned yet (a first start, from zero): the prefill term alone counts the backlog
        return 0.0
    return backlog_drain_rps(samples, spec.cold_start_s) * hold_s


def backlog_drain_rps(recent: Sequence[Sample], cold_start_s: float) -> float:
    """The extra requests a second that drain the backlog the fleet will hold when replicas ordered now arrive.

    The queue keeps growing at its recent slope g until new capacity lands one cold start L later, so it will
    hold Q + g x L by then; served over one more L that is Q / L + g more a second. Counting only Q / L missed
    the growth at a spike's onset (the --bursty trace: 12 replicas ordered where 20 were needed, 85.6% instead
    of 89.6%). Worked: 100 queued, growing 30 a second over the panic window, L 50 s -> 2 + 30 = 32 rps.
    """
    if not recent:
        return 0.0
    growth = 0.0
    if len(recent) > 1 and recent[-1].t > recent[0].t:
        growth = max(0.0, (recent[-1].queued - recent[0].queued) / (recent[-1].t - recent[0].t))
    return _mean([x.queued for x in recent]) / cold_start_s + growth


def arrival_dispersion(samples: tuple[Sample, ...], stable_rps: float) -> float:
    """How bursty arrivals are, as the queueing model's c_a^2: the variance of per-second arrival counts over
    their mean, the index of dispersion (1 for Poisson arrivals; k when they come in batches of k, as a client
    fanning out k requests at once), from the samples that carry it; 1 when none does. Held to [0.5, 50]:
    one odd window must not ask for a fleet of hundreds. Worked: 8 rps with a variance of 24 -> 3."""
    known = [x.arrivals_var for x in samples if x.arrivals_var is not None]
    if not known or stable_rps <= 0:
        return 1.0
    return min(50.0, max(0.5, _mean(known) / stable_rps))


def window_noise_peak_rps(stable_rps: float, c_a2: float, window_s: float, keep_s: float) -> float:
    """How far above the true rate the highest of the stable window's means over `keep_s` reads on a steady load:
    the expected maximum of keep_s / window_s independent means (Blom's approximation of a normal maximum), each
    with the sampling noise sqrt(c_a^2 x rate / window). The scale-down window keeps the most wanted over that
    time, so without this it keeps a noise peak: on 20 requests/s of steady Poisson traffic (the decode-heavy
    shape in the simulator, 600 s kept) it held 17-18 replicas where 16 served every request. 0 when the keep
    spans at most one window. Worked: 20 rps, c_a^2 1, 60 s windows, 600 s kept -> 10 means, 1.54 x 0.58 = 0.89."""
    n = keep_s / window_s if window_s > 0 else 0.0
    if n <= 1.0 or stable_rps <= 0:
        return 0.0
    return _UNIT.inv_cdf((n - 0.375) / (n + 0.25)) * math.sqrt(c_a2 * stable_rps / window_s)


def work_demand(capacity: ReplicaCapacity, samples: tuple[Sample, ...], c_s2: float, hold_s: float | None,
                forecast_rps: float | None, scaling: Scaling, cold_start_s: float, now: float,
                drift_rps: float = 0.0, learned_prefill_per_replica_s: float = 0.0,
                keep_s: float = 0.0) -> tuple[int, int, str]:
    """The replicas the work needs (`autoscaler.work`): the most of what prefill needs and, once a request's time
    in service `hold_s` is learned, what the batch slots need; the same without the backlog and the rate's noise
    peak (what the scale-down window keeps for `keep_s`: a drained backlog is not load that comes back, and the
    window's maximum would keep the peak of the rate's noise: `window_noise_peak_rps`); and why, in one phrase.

    The rate planned for is the higher of the forecast's and the stable window's (the panic window's once it
    stands out of its noise: a burst counts as soon as it shows), plus `drift_rps` (`DRIFT_SIGMAS` deviations
    of the rate's move over a cold start) and the backlog to drain (`backlog_drain_rps`); the prompts' mean is
    the stable window's, their spread `c_s2` longer's. Worked: 8 rps over 60 s, 12 over the last 6 s (noise
    2.3), 24,000 prompt tokens/s over 60 s, 100 queued and steady, cold start 50 s, no drift -> 14 rps of 3,000
    (12 kept).
    """
    stable_rps = _mean([x.arrivals_per_s for x in samples])
    if stable_rps <= 0:
        return 0, 0, ""
    recent = [x for x in samples if x.t > now - scaling.panic_window_s]
    panic_rps = _mean([x.arrivals_per_s for x in recent])
    backlog_rps = backlog_drain_rps(recent, max(cold_start_s, scaling.panic_window_s))
    c_a2 = arrival_dispersion(samples, stable_rps)
    # The panic window's rate counts when it is above the stable one by more than its own noise (two standard
    # deviations of a count over the panic window at the stable rate): otherwise the scale-down delay, which
    # keeps the most wanted over its length, would keep the noise's peaks.
    noise_rps = 2.0 * math.sqrt(c_a2 * stable_rps / scaling.panic_window_s)
    burst_rps = panic_rps if panic_rps > stable_rps + noise_rps else stable_rps
    steady_rps = max(burst_rps, forecast_rps or 0.0) + DRIFT_SIGMAS * drift_rps
    sizing = _WorkSizing(capacity, _mean([x.prompt_tokens_per_s for x in samples]) / stable_rps, c_s2, c_a2, hold_s,
                         learned_prefill_per_replica_s, scaling.max_replicas + 1)
    rate = steady_rps + backlog_rps
    prefill, slots, why = sizing.count(rate)
    # The window keeps bursts: on the --bursty trace (spikes in runs) a burst's count kept two cold starts only, as a
    # backlog's is, fell from 85.5% to 82.5%. It does not keep the stable rate's noise peak (`window_noise_peak_rps`).
    kept_rps = max(0.0, max(burst_rps, forecast_rps or 0.0) - window_noise_peak_rps(
        stable_rps, c_a2, scaling.stable_window_s, keep_s)) + DRIFT_SIGMAS * drift_rps
    keep = max(prefill, slots) if rate == kept_rps else max(sizing.count(kept_rps)[:2])
    return max(prefill, slots), keep, why


@dataclass(frozen=True, slots=True)
class _WorkSizing:
    """`work_demand`'s sizing at one rate: prefill replicas, slot replicas and the phrase saying why."""

    capacity: ReplicaCapacity
    mean_tokens: float
    c_s2: float
    c_a2: float
    hold_s: float | None
    learned_prefill_per_replica_s: float
    limit: int

    def count(self, rate: float) -> tuple[int, int, str]:
        capacity = self.capacity
        load = PromptLoad(rate, self.mean_tokens, self.c_s2)
        prefill = prefill_replicas(capacity, load, c_a2=self.c_a2, limit=self.limit)
        slack_s = max(0.0, capacity.ttft_slo_s - load.mean_tokens / capacity.prefill_tokens_per_s)
        hold = (None if self.hold_s is None
                else SlotHold.for_load(capacity, self.hold_s, load, self.learned_prefill_per_replica_s))
        if hold is None:
            slots = 0
        else:
            # A request misses on the prefill queue or on a wait for a slot: the slots may use what the prefill
            # queue leaves of the budget at the same count (nearly all of it on short prompts). A fixed tenth kept
            # a third replica, and a second node, for 5 requests/s of Azure traffic that two served at 99.2%.
            budget = miss_budget(capacity, load)
            slots = slot_replicas(capacity, rate, hold, slack_s=slack_s, c_a2=self.c_a2, limit=self.limit,
                                  allowed_at=lambda n: budget - ttft_miss(n, load, capacity, self.c_a2))
        if max(prefill, slots) == 0:
            return 0, 0, ""
        why = (f"work {rate:.1f} rps (c_a² {self.c_a2:.1f}): prefill {load.mean_tokens:.0f} tokens "
               f"(c_s² {load.c_s2:.1f}) at {capacity.prefill_tokens_per_s:g}/s, {capacity.attainment:.0%} within "
               f"{capacity.ttft_slo_s:g}s -> {prefill}")
        if hold is not None:
            held = hold.at(slots)
            why += f"; slots {rate * held:.0f} busy ({held:.1f}s each) of {capacity.max_batch} a replica -> {slots}"
        return prefill, slots, why


def forecast_concurrency(forecast_rps: float | None, level_rps: float | None, samples: tuple[Sample, ...],
                         stable_conc: float) -> float | None:
    """The concurrency the forecast rate will bring; None unless the trend is rising.

    Only a significant rising trend adds replicas: the forecast's level alone is a noisier copy of what
    the stable window already says, and counting it would flap on steady load. Little's law turns the
    rate into concurrency: concurrency = arrival rate x time in system, and the stable window gives the
    latter (its concurrency per arrival/s). Worked numbers: 20 ongoing at 10 rps over the window and
    15 rps forecast -> 30 ongoing.
    """
    mean_rps = _mean([x.arrivals_per_s for x in samples])
    rising = forecast_rps is not None and level_rps is not None and forecast_rps > level_rps
    if not (rising and forecast_rps is not None and mean_rps > 0):
        return None
    return forecast_rps * stable_conc / mean_rps


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


def rate_keep_s(spec: ScalerSpec) -> float:
    """How long the work model's count for the arrival rate is kept: the scale-down delay, and never less than a
    cold start (a replica let go is back no sooner: ski rental's break-even). In `examples/sim` every model's delay
    is longer than its cold start (chat-70b 300 s against 180 s, burst-8b 600 s against 50 s), so this floor has
    not yet changed a simulated run."""
    return max(spec.scaling.scale_down_delay_s, spec.cold_start_s)


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
    hold = learn_hold(state.hold, obs, samples, now)
    hold_s = hold.settled_hold_s(now)
    history_s = now - samples[0].t
    warming = history_s < s.panic_window_s
    # A gateway's first rates cover less than its window (0 before its second sample): a fresh scaler's first
    # seconds would pass for a rise of the whole load, and the scale-down delay would keep that for minutes.
    # The drift is measured on the stable window's mean rate, its sampling noise taken out (`RateDrift`), over a
    # cold start plus the half window that mean lags behind the rate now.
    stable_rps = _mean([x.arrivals_per_s for x in samples])
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
