"""The policies the simulator compares: kvgate's own scaler and four baselines.

Every policy is a frozen object with `decide(state, obs, now) -> (state, SimDecision)`, pure over a
small frozen state that the engine keeps. All read the same `ModelObservation` (queued + running =
ongoing requests) and the same `target` per replica (the registry's `scaling.target_ongoing_requests`),
so they differ only in their rules:

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
- `StaticPolicy`: a fixed count (static at peak: the oracle's peak need), never changes.
- `OraclePolicy`: knows the future. `need[s]` is the replicas second `s` needs (from the trace replayed
  on unlimited replicas, see `oracle_need`); it asks at t for the most needed over [t, t + cold start],
  so replicas are ready exactly when load lands and released as soon as it leaves. The cheapest of these
  that meets the goal is a yardstick, not a bound: a schedule outside the family may cost less (capping its
  need curve did, by 1-4%). The bound is `sim/bound.py`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from kvgate.autoscaler.scaler import ModelObservation, ScalerSpec, ScalerState, decide_replicas
from kvgate.autoscaler.sim.records import SimDecision
from kvgate.autoscaler.sim.service import ServiceModel
from kvgate.autoscaler.sim.traces import Trace

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
    slots) and ceil(prefill seconds arriving per second / utilization) (the one-at-a-time prefill).

    Concurrency is counted on unlimited replicas (each request busy from arrival to its last token,
    no queueing). With `window_s` 0 it is the peak within the second (never short of a slot); with
    `window_s` w > 0 the mean over the w seconds around it (short queues allowed, fewer replicas).
    Prefill work is averaged over max(10, w) seconds: a prefill queue of a few seconds is what the
    batch slots' headroom already allows. `utilization` in (0, 1] leaves headroom for queueing and
    uneven batches. The comparison searches both for the cheapest schedule that still meets the SLO.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    seconds = int(trace.duration_s + tail_s) + 2
    events: list[tuple[float, int]] = []
    for request in trace.requests:
        end = request.arrival_s + service.prefill_s(request.input_tokens) + service.decode_s(request.output_tokens)
        events += [(request.arrival_s, 1), (end, -1)]
    events.sort()  # at equal times a departure (-1) comes first: the slot is free for the arrival
    prefill = [0.0] * seconds
    for request in trace.requests:
        prefill[min(seconds - 1, int(request.arrival_s))] += service.prefill_s(request.input_tokens)
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
    if window_s > 0:
        peak = _centred_mean(area, window_s)
    prefill = _centred_mean(prefill, max(10, window_s))
    capacity = service.max_batch * utilization
    return tuple(max(_ceil_div(slots, capacity), _ceil_div(work, utilization)) for slots, work in zip(peak, prefill))


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
