"""The policies the simulator compares: kvgate's own scaler and six baselines.

Every policy is a frozen object with `decide(state, obs, now) -> (state, SimDecision)`, pure over a
small frozen state that the engine keeps; each is the replica step of the live loop's decision
(`autoscaler.decide`), so drains, back-off and the node planner are the same for all. All read the same
`ModelObservation`; KPA and Ray Serve scale on the registry's `scaling.target_ongoing_requests` per
replica, llm-d on KV use and queues, Dynamo on the registry's throughput figures:

- `KvgatePolicy`: `autoscaler.scaler.decide_replicas`, the function the live loop calls, unchanged.
- `KpaPolicy`: Knative's KPA with its published defaults (pkg/autoscaler/scaling/autoscaler.go):
  tick 2 s; stable window 60 s, panic window 6 s; desired = ceil(window-average concurrency /
  (target x target utilization 70%)); panic when panic-window desire / ready >= 2.0, and in panic the
  count never drops; panic ends when no threshold crossing happened for a stable window; max scale up
  rate 1000x, max scale down rate 2x per tick; scale to zero once nothing was ongoing for the stable
  window plus the 30 s grace; the activator asks for 1 at once when a request waits at zero.
- `RayServePolicy`: Ray Serve's default autoscaling (serve/autoscaling_policy.py): desired =
  ceil(ongoing averaged over look_back 30 s / target_ongoing_requests); a change applies once it has
  been wanted continuously for upscale_delay 30 s (up) or downscale_delay 600 s (down), then to the
  count wanted at that moment; 0 -> 1 at once when requests wait.
- `LlmdSaturationPolicy`: llm-d's workload-variant autoscaler, saturation mode (its docstring has the rules).
- `DynamoPlannerPolicy`: NVIDIA Dynamo's SLA planner (its docstring has the rules).
- `StaticPolicy`: a fixed count (static at peak: the oracle's peak need), never changes.
- `OraclePolicy`: knows the future. `need[s]` is the replicas second `s` needs (from the trace replayed
  on unlimited replicas, see `oracle_need`); it asks at t for the most needed over [t, t + cold start],
  so replicas are ready exactly when load lands and released as soon as it leaves. The cheapest of these
  that meets the goal is a yardstick, not a bound: a schedule outside the family may cost less (capping its
  need curve did, by 1-4%). The bound is `sim/bound.py`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from kvgate.autoscaler.demand import ModelObservation, ScalerSpec
from kvgate.autoscaler.scaler import ScalerState, decide_replicas
from kvgate.autoscaler.sim.records import SimDecision
from kvgate.autoscaler.sim.service import ServiceModel
from kvgate.autoscaler.sim.traces import Trace, least_prefill_tokens
from kvgate.autoscaler.work import decode_slowdown, prefill_beside_decode

_EPS = 1e-9


def _ceil_div(value: float, target: float) -> int:
    return max(0, math.ceil(value / target - _EPS))


@dataclass(frozen=True)
class _Window:
    """(t, value) samples of the last `span_s` seconds, oldest first."""

    samples: tuple[tuple[float, float], ...] = ()

    def add(self, now: float, value: float, span_s: float) -> _Window:
        kept = tuple(s for s in self.samples if s[0] > now - span_s)
        return _Window(kept + ((now, value),))

    def mean(self, now: float, span_s: float) -> float:
        values = [v for t, v in self.samples if t > now - span_s]
        return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class _Baseline:
    """What the KPA and Ray Serve baselines share: the registry's target per replica and replica limits
    (the fields the comparison passes, in this order), and a state that starts empty (`state_type()`)."""

    target: float  # target ongoing requests per replica (KPA: `autoscaling.knative.dev/target`)
    min_replicas: int = 0
    max_replicas: int = 1_000
    state_type: ClassVar[type]  # set by each subclass

    def initial_state(self) -> Any:
        return self.state_type()

    def within_limits(self, replicas: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, replicas))


# ------------------------------------------------------------------------------------------ kvgate


@dataclass(frozen=True)
class KvgatePolicy:
    spec: ScalerSpec
    tick_s: float = 1.0
    name: str = "kvgate"

    def initial_state(self) -> ScalerState:
        return ScalerState()

    def decide(self, state: ScalerState, obs: ModelObservation, now: float) -> tuple[ScalerState, SimDecision]:
        state, decision = decide_replicas(self.spec, state, obs, now)
        return state, SimDecision(decision.desired, decision.panic, decision.forecast_rps, decision.reason)


# -------------------------------------------------------------------------------------- Knative KPA


@dataclass(frozen=True)
class KpaState:
    window: _Window = _Window()
    panic_since: float | None = None  # last tick over the panic threshold; None: not panicking
    max_panic: int = 0
    idle_since: float | None = None
    desired: int | None = None


@dataclass(frozen=True)
class KpaPolicy(_Baseline):
    target_utilization: float = 0.7  # container-concurrency-target-percentage default
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_to_zero_grace_s: float = 30.0
    tick_s: float = 2.0
    name: str = "kpa"
    state_type: ClassVar[type] = KpaState

    def decide(self, state: KpaState, obs: ModelObservation, now: float) -> tuple[KpaState, SimDecision]:
        window = state.window.add(now, obs.ongoing, self.stable_window_s)
        target = self.target * self.target_utilization
        ready = max(1, obs.ready_replicas)
        stable = _ceil_div(window.mean(now, self.stable_window_s), target)
        panic_value = window.mean(now, self.panic_window_s) / target  # unrounded, as Knative compares it
        panic = _ceil_div(window.mean(now, self.panic_window_s), target)
        max_up = math.ceil(self.max_scale_up_rate * ready)
        max_down = math.floor(ready / self.max_scale_down_rate)
        stable, panic = min(max_up, max(max_down, stable)), min(max_up, max(max_down, panic))
        over = panic_value / ready >= self.panic_threshold
        panic_since = state.panic_since
        max_panic = state.max_panic
        if over:
            panic_since = now
        elif panic_since is not None and now - panic_since > self.stable_window_s:
            panic_since, max_panic = None, 0
        desired = stable
        if panic_since is not None:
            desired = max(desired, panic)
            max_panic = max(max_panic, desired)
            desired = max_panic
        idle = obs.ongoing == 0 and obs.arrivals_per_s == 0
        idle_since = (now if state.idle_since is None else state.idle_since) if idle else None
        if desired == 0:
            if obs.ongoing > 0:
                desired = 1  # the activator holds the request and pokes the autoscaler at once
            elif idle_since is None or now - idle_since < self.stable_window_s + self.scale_to_zero_grace_s:
                # Zero only once the stable window has been empty and the grace period has passed.
                desired = min(1, state.desired if state.desired is not None else obs.ready_replicas)
        desired = self.within_limits(desired)
        new = KpaState(window, panic_since, max_panic, idle_since, desired)
        return new, SimDecision(desired, panic_since is not None, None, f"stable {stable} panic {panic}")


# ---------------------------------------------------------------------------------------- Ray Serve


@dataclass(frozen=True)
class RayState:
    window: _Window = _Window()
    wanting_since: float | None = None
    wanting_up: bool = False
    current: int | None = None


@dataclass(frozen=True)
class RayServePolicy(_Baseline):
    look_back_period_s: float = 30.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    tick_s: float = 1.0
    name: str = "ray-serve"
    state_type: ClassVar[type] = RayState

    def decide(self, state: RayState, obs: ModelObservation, now: float) -> tuple[RayState, SimDecision]:
        window = state.window.add(now, obs.ongoing, self.look_back_period_s)
        current = state.current if state.current is not None else obs.ready_replicas + obs.starting_replicas
        wanted = self.within_limits(_ceil_div(window.mean(now, self.look_back_period_s), self.target))
        since, up = state.wanting_since, state.wanting_up
        if current == 0 and obs.ongoing > 0:
            current, since = max(1, wanted), None  # scale from zero at once
        elif wanted == current:
            since = None
        else:
            if since is None or up != (wanted > current):
                since, up = now, wanted > current
            delay = self.upscale_delay_s if up else self.downscale_delay_s
            if now - since >= delay:
                current, since = wanted, None
        new = RayState(window, since, up, current)
        return new, SimDecision(current, False, None, f"wanted {wanted}")


# ---------------------------------------------------------------------------------- llm-d saturation


@dataclass(frozen=True)
class SaturationState:
    kv: _Window = _Window()  # the mean replica's KV use (running / batch slots), per tick
    queue: _Window = _Window()  # requests waiting per ready replica, per tick
    current: int | None = None
    decided_at: float | None = None
    idle_since: float | None = None


@dataclass(frozen=True)
class LlmdSaturationPolicy:
    """llm-d's workload-variant autoscaler in its saturation (capacity-only) mode, as its docs state it
    (llm-d-incubation/workload-variant-autoscaler, docs/saturation-analyzer.md and saturation-scaling-config.md).

    Every `interval_s` (GLOBAL_OPT_INTERVAL, 60 s), over the peak of the last minute (`max_over_time[1m]`) of each
    replica's KV-cache use and waiting queue: a replica is saturated at KV >= 80% or a queue >= 5; over the
    others, spare KV = 0.8 - use and spare queue = 5 - queue are averaged; below 0.1 or 3, one replica more than
    are ready (`readyReplicas + 1`: no more while new ones start). One fewer only when the load of N spread over
    N - 1 still leaves both spares at their triggers, and N >= 2.

    Adapted to what the simulator shows: replicas are interchangeable, so every replica's KV use is the fleet's
    running requests over its batch slots (sequences stand in for KV blocks) and its queue the requests queued
    per ready replica. From zero: one replica as soon as a request waits (llm-d's flow control holds it); to zero
    only where the registry allows, after `scale_to_zero_grace_s` idle (the registry's value).
    """

    max_batch: int  # a replica's batch slots (the service model's)
    min_replicas: int = 0
    max_replicas: int = 1_000
    kv_threshold: float = 0.80
    queue_threshold: float = 5.0
    kv_spare_trigger: float = 0.10
    queue_spare_trigger: float = 3.0
    interval_s: float = 60.0
    window_s: float = 60.0
    scale_to_zero_grace_s: float = 300.0
    tick_s: float = 1.0
    name: str = "llm-d"

    def initial_state(self) -> SaturationState:
        return SaturationState()

    def decide(self, state: SaturationState, obs: ModelObservation,
               now: float) -> tuple[SaturationState, SimDecision]:
        ready = obs.ready_replicas
        kv_now = obs.running / (ready * self.max_batch) if ready else 0.0
        queue_now = obs.queued_at_gateways / ready if ready else float(obs.queued_at_gateways)
        kv = state.kv.add(now, kv_now, self.window_s)
        queue = state.queue.add(now, queue_now, self.window_s)
        current = state.current if state.current is not None else ready + obs.starting_replicas
        idle = obs.ongoing == 0 and obs.arrivals_per_s == 0
        idle_since = (now if state.idle_since is None else state.idle_since) if idle else None
        if current == 0 and obs.ongoing > 0:
            return SaturationState(kv, queue, 1, now), SimDecision(1, reason="scale from zero: a request waits")
        if self.min_replicas == 0 and idle_since is not None and now - idle_since >= self.scale_to_zero_grace_s:
            return SaturationState(kv, queue, 0, now, idle_since), SimDecision(0, reason="idle: to zero")
        due = state.decided_at is None or now - state.decided_at >= self.interval_s
        if not due or ready == 0:
            held = SaturationState(kv, queue, current, state.decided_at, idle_since)
            return held, SimDecision(current, reason="holding")
        kv_peak = max((v for t, v in kv.samples), default=0.0)
        queue_peak = max((v for t, v in queue.samples), default=0.0)
        saturated = kv_peak >= self.kv_threshold or queue_peak >= self.queue_threshold
        spare_kv, spare_queue = self.kv_threshold - kv_peak, self.queue_threshold - queue_peak
        target, why = current, f"KV {kv_peak:.0%}, queue {queue_peak:.1f} a replica"
        if saturated or spare_kv < self.kv_spare_trigger or spare_queue < self.queue_spare_trigger:
            target = ready + 1
        elif ready >= 2:
            kv_after, queue_after = kv_peak * ready / (ready - 1), queue_peak * ready / (ready - 1)
            if (self.kv_threshold - kv_after >= self.kv_spare_trigger
                    and self.queue_threshold - queue_after >= self.queue_spare_trigger):
                target = ready - 1
        target = min(self.max_replicas, max(self.min_replicas, target))
        return SaturationState(kv, queue, target, now, idle_since), SimDecision(target, reason=why)


# --------------------------------------------------------------------------------- Dynamo SLA planner


@dataclass(frozen=True)
class PlannerLoad:
    arrivals: _Window = _Window()
    prompt_tokens: _Window = _Window()
    current: int | None = None
    decided_at: float | None = None


@dataclass(frozen=True)
class DynamoPlannerPolicy:
    """NVIDIA Dynamo's SLA planner, as its docs state it (ai-dynamo/dynamo, docs/architecture/sla_planner.md;
    defaults in components/planner/defaults.py).

    Every `interval_s` (adjustment_interval, 180 s) it predicts the next interval's requests and input length and
    sizes replicas from the profiled throughput at the SLA:
        prefill = ceil(requests x ISL / interval / prefill tokens/s a replica)
        decode  = ceil(requests x OSL / interval / decode tokens/s a replica)
    kvgate's replicas serve both phases, so the count is the larger of the two; at least `min_endpoint` (1).

    Choices where the planner has options: the "constant" load predictor (documented: the next interval's load is
    the last one's; the default, ARIMA, needs pmdarima and a history of 50 intervals); no correction factor
    (documented `no_correction`; the simulator reports no TTFT); the profiled throughputs are the registry's
    `prefill_tokens_per_s` and `decode_tokens_per_s` of the slowest allowed GPU kind, the same figures kvgate
    reads; OSL is the trace's mean output length, standing in for the profile's (the gateway reports no output
    lengths). `headroom` divides the throughputs (1.0 as documented; the sweep raises it).
    """

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    osl: float
    min_replicas: int = 1
    max_replicas: int = 1_000
    interval_s: float = 180.0
    headroom: float = 1.0
    tick_s: float = 1.0
    name: str = "dynamo"

    def initial_state(self) -> PlannerLoad:
        return PlannerLoad()

    def decide(self, state: PlannerLoad, obs: ModelObservation, now: float) -> tuple[PlannerLoad, SimDecision]:
        arrivals = state.arrivals.add(now, obs.arrivals_per_s, self.interval_s)
        prompts = state.prompt_tokens.add(now, obs.prompt_tokens_per_s, self.interval_s)
        current = state.current if state.current is not None else obs.ready_replicas + obs.starting_replicas
        floor = max(1, self.min_replicas)
        # The planner adjusts at the end of each interval, over the load it measured in it: the first one ends
        # an interval after it starts, and until then the fleet stays as it found it.
        started = now if state.decided_at is None else state.decided_at
        if now - started < self.interval_s:
            current = max(current, floor)
            held = PlannerLoad(arrivals, prompts, current, started)
            return held, SimDecision(current, reason="measuring the interval")
        rate, prompt_rate = arrivals.mean(now, self.interval_s), prompts.mean(now, self.interval_s)
        prefill = _ceil_div(prompt_rate * self.headroom, self.prefill_tokens_per_s)
        decode = _ceil_div(rate * self.osl * self.headroom, self.decode_tokens_per_s)
        target = min(self.max_replicas, max(floor, prefill, decode))
        why = f"{rate:.1f} req/s, {prompt_rate:.0f} prompt tok/s: prefill {prefill}, decode {decode}"
        return PlannerLoad(arrivals, prompts, target, now), SimDecision(target, reason=why)


# ------------------------------------------------------------------------------------ static, oracle


@dataclass(frozen=True)
class StaticPolicy:
    replicas: int
    tick_s: float = 60.0
    name: str = "static-peak"

    def initial_state(self) -> None:
        return None

    def decide(self, state: None, obs: ModelObservation, now: float) -> tuple[None, SimDecision]:
        return None, SimDecision(self.replicas, reason="static")


@dataclass(frozen=True)
class OraclePolicy:
    need: tuple[int, ...]  # replicas needed in each second of the trace
    cold_start_s: float
    min_replicas: int = 0
    tick_s: float = 1.0
    name: str = "oracle"

    def initial_state(self) -> None:
        return None

    def decide(self, state: None, obs: ModelObservation, now: float) -> tuple[None, SimDecision]:
        start = int(now)
        ahead = self.need[start:start + int(math.ceil(self.cold_start_s)) + 1]
        desired = max(ahead, default=0)
        if desired == 0 and obs.ongoing > 0:
            desired = 1
        return None, SimDecision(max(self.min_replicas, desired), reason="foresight")


def oracle_need(trace: Trace, service: ServiceModel, utilization: float, *, window_s: int = 0,
                tail_s: float = 0.0) -> tuple[int, ...]:
    """Replicas each second needs: the more of ceil(concurrency / (max_batch x utilization)) (batch
    slots) and ceil(prefill seconds arriving per second / utilization) (the prefill).

    Both as the engine steps run them (`batching.py`): prefill at the rate left beside decode
    (`work.prefill_beside_decode`), and a replica that spends a share r of its time prefilling decodes at 1 - r
    of its speed, so the decode part of each request's hold, and with it the concurrency, is 1 / (1 - r) as long;
    r is the prefill's share (at the bare rate: the decode's part of a step is what slows) of that second's
    replicas. The need and the slowdown depend on each other (fewer replicas, a larger share, longer holds, more
    replicas), so each second's count is their fixed point: the fewest n whose own slowdown needs no more than n,
    bisected between the need at full-speed decode (below it) and the need at that count's slowdown (above it).
    Two plain rounds overshot, the more the higher the utilization: Azure x10's peak curve asked 53 replicas at
    100% and 36 at 76%.

    Concurrency is counted on unlimited replicas (each request busy from arrival to its last token,
    no queueing). With `window_s` 0 it is the peak within the second (never short of a slot); with
    `window_s` w > 0 the mean over the w seconds around it (short queues allowed, fewer replicas).
    Prefill work is averaged over max(10, w) seconds: a prefill queue of a few seconds is what the
    batch slots' headroom already allows. `utilization` in (0, 1] leaves headroom for queueing and
    uneven batches. The oracle's search (`oracle.py`) tries both for the cheapest schedule that still meets the
    SLO.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    seconds = int(trace.duration_s + tail_s) + 2
    prompt = least_prefill_tokens(trace)  # after prefixes earlier requests share, where the trace says
    prefill = [0.0] * seconds
    for request, tokens in zip(trace.requests, prompt):
        prefill[min(seconds - 1, int(request.arrival_s))] += service.prefill_s(tokens)
    prefill = _centred_mean(prefill, max(10, window_s))
    beside = service.prefill_tokens_per_s / prefill_beside_decode(service.prefill_tokens_per_s,
                                                                  service.decode_tokens_per_s, service.max_batch,
                                                                  service.max_batch_tokens)
    capacity = service.max_batch * utilization

    def needs(replicas: Sequence[int] | None) -> list[int]:
        """Each second's need with the decode slowed as `replicas` (None: not at all) would run it."""
        slowdown = ([1.0] * seconds if replicas is None else
                    [decode_slowdown(work, n) if n else 1.0 for work, n in zip(prefill, replicas)])
        slots = _concurrency(trace, prompt, service, slowdown, seconds, window_s)
        return [max(_ceil_div(busy, capacity), _ceil_div(work * beside, utilization))
                for busy, work in zip(slots, prefill)]

    low = needs(None)  # never above the fixed point: the slowdown only adds
    high = needs(low)  # never below it: the fewer replicas, the more they need
    while any(h > lo for lo, h in zip(low, high)):
        middle = [(lo + h) // 2 for lo, h in zip(low, high)]
        enough = [need <= n for need, n in zip(needs(middle), middle)]
        high = [n if ok else h for n, ok, h in zip(middle, enough, high)]
        low = [lo if ok else n + 1 for n, ok, lo in zip(middle, enough, low)]
    return tuple(high)


def _concurrency(trace: Trace, prompt: list[int], service: ServiceModel, slowdown: list[float], seconds: int,
                 window_s: int) -> list[float]:
    """Requests busy each second on unlimited replicas, each from arrival to its last token with its decode
    `slowdown[its arrival second]` times as long: the peak within the second (`window_s` 0), else the mean over
    the `window_s` seconds around it."""
    events: list[tuple[float, int]] = []
    for request, tokens in zip(trace.requests, prompt):
        second = min(seconds - 1, int(request.arrival_s))
        end = (request.arrival_s + service.prefill_s(tokens)
               + service.decode_s(request.output_tokens) * slowdown[second])
        events += [(request.arrival_s, 1), (end, -1)]
    events.sort()  # at equal times a departure (-1) comes first: the slot is free for the arrival
    peak, area = [0.0] * seconds, [0.0] * seconds
    level = index = 0
    for second in range(seconds):
        top, t, integral = level, float(second), 0.0  # what the previous second ended with carries in
        while index < len(events) and events[index][0] < second + 1:
            integral += level * (events[index][0] - t)
            t = events[index][0]
            level += events[index][1]
            top = max(top, level)
            index += 1
        peak[second], area[second] = top, integral + level * (second + 1 - t)
    return _centred_mean(area, window_s) if window_s > 0 else peak


def _centred_mean(values: list[float], window_s: int) -> list[float]:
    half, n = window_s // 2, len(values)
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    return [(prefix[min(n, s + half + 1)] - prefix[max(0, s - half)]) / (min(n, s + half + 1) - max(0, s - half))
            for s in range(n)]


def with_name(policy: object, name: str) -> object:
    """The same policy under another name (for two settings of one baseline in one table)."""
    return replace(policy, name=name)  # type: ignore[type-var]
