"""What one model's windows ask for: the scaler's inputs (`ModelObservation`, `ScalerSpec`), its samples, and
`measure_demand`, which turns a stable window of samples into replica counts, by concurrency against the
target (Knative KPA, Ray Serve) and, for a model with a TTFT SLO and performance figures, by work
(`work_demand` over the queueing model in `autoscaler.work`). `autoscaler.scaler` decides from these counts.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

from kvgate.autoscaler.forecast import ForecastSettings, ForecastState, forecast_rate
from kvgate.autoscaler.work import (DRIFT_SIGMAS, LittleLaw, PromptLoad, PromptSpread, ReplicaCapacity, SlotHold,
                                    miss_budget, prefill_replicas, slot_replicas, ttft_miss)
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



def _ceil_div(value: float, target: float) -> int:
    return max(0, math.ceil(value / target - _EPS))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0




def rate_keep_s(spec: ScalerSpec) -> float:
    """How long the work model's count for the arrival rate is kept: the scale-down delay, and never less than a
    cold start (a replica let go is back no sooner: ski rental's break-even). In `examples/sim` every model's delay
    is longer than its cold start (chat-70b 300 s against 180 s, burst-8b 600 s against 50 s), so this floor has
    not yet changed a simulated run."""
    return max(spec.scaling.scale_down_delay_s, spec.cold_start_s)




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


# A request's time in service is averaged over this many stable windows: it then describes the traffic the window's
# rate does, and one window more lets Little's law's edges (requests in flight at either end) cancel. Averaged over
# five minutes it lagged the mix: on the Azure trace busier minutes bring shorter requests (8 requests/s held 4.3 s
# each where 5 had held 6.5), and a 300 s hold sized x5 at 1.27x the oracle's GPU-hours (1.18x at 120 s); when the
# prompts grew by half at minute 52, replicas with a 90 s cold start came up short for four minutes (98.9% against
# 99.8%). Over one window, mmpp's on/off edges no longer cancelled (3.76x the oracle against 3.32x).
HOLD_WINDOWS = 2.0


def learn_hold(hold: LittleLaw, obs: ModelObservation, samples: Sequence[Sample], now: float,
               time_constant_s: float = HOLD_WINDOWS * 60.0) -> LittleLaw:
    """`hold` with this tick's running and completions added: Little's law over the replicas alone, which holds at
    every tick, a backlog waiting at the gateways or not. Idle ticks (nothing running or finishing) count: they are
    part of the averages, each over `time_constant_s` (the scaler passes `HOLD_WINDOWS` stable windows). Worked: 60
    running, 12 finishing a second -> 5 s.

    From gateways that report no completions, arrivals stand in for them, which holds only with nothing queued now
    nor in the window's samples: under a backlog running is the batch's cap and arrivals outrun completions; just
    after one, the backlog's requests are still in service. Learning only then, a fleet short of slots (a queue most
    ticks) kept the short hold it learned while its load first rose (16 s for 23 on decode-heavy traffic in the
    simulator) and was sized on it, short again."""
    per_replica = obs.prompt_tokens_per_s / max(1, obs.ready_replicas)
    if obs.completions_per_s is not None:
        return hold.add(obs.running, obs.completions_per_s, now, time_constant_s, per_replica)
    if obs.queued_at_gateways + obs.waiting > 0 or any(x.queued > 0 for x in samples):
        return hold
    return hold.add(obs.running, obs.arrivals_per_s, now, time_constant_s, per_replica)


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
