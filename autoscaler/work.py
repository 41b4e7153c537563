"""Scaling on work: the replicas a model's prompt load needs for its TTFT SLO, from a queueing model.

Concurrency (requests queued or running) measures a replica's batch slots, not its prefill. A request
with 2,000 prompt tokens and 30 output tokens holds a slot for under a second but takes 0.22 s of an
L40S's prefill (9,000 tokens/s), so 16 such requests ongoing, burst-8b's concurrency target, ask one
replica for 3.8 s of prefill a second: the concurrency rule sees no load while the prefill queue grows.
This module sizes the fleet from the prompt tokens per second instead, against each replica's prefill
throughput declared in the registry (`performance.gpu_kinds[].prefill_tokens_per_s`).

The headroom comes from the SLO and a queueing model, not from a trace. The fleet's prefill is taken as
a GI/G/c queue: c replicas, λ requests/s, each prefill lasting S = prompt tokens / prefill_tokens_per_s.
With a = λ·E[S] (the offered load, in replicas) and C(c, a) Erlang's probability that a request waits,
the Allen-Cunneen approximation of the waiting time's tail is

    P(W > t) ≈ C(c, a) · exp(−θ t),   θ = (c / E[S] − λ) · 2 / (c_a² + c_s²)

(exact for M/M/c, where both squared coefficients of variation are 1; the factor 2 / (c_a² + c_s²) is the
usual heavy-traffic correction for burstier arrivals or more variable prompts). A request's time to first
token is its wait plus its own prefill, so the miss rate is P(W + S > SLO), with S lognormal at the
window's mean and variance of prompt lengths (request sizes in public traces are close to lognormal):

    P(W + S > T) = P(S > T) + C · E[exp(−θ (T − S)); S ≤ T]

The fleet needs the fewest c for which that is at most the share allowed to miss (1 − the SLO's
attainment goal). Prompts so long that their prefill alone passes the SLO miss whatever the fleet does;
they use up that share first, and the queue may then add up to half the goal's share on top: where
prefill alone nearly breaks the goal, each replica more buys almost nothing (prefill-heavy at 20
requests/s in the simulator: 9 replicas miss 0.84%, 13 miss 0.69%), and a smaller allowance made the
count swing between 9 and 13 on a minute's noise in the prompt mix. Taking one replica
away is the same test at c − 1, so a count this module returns is one whose N − 1 was computed and found
short: llm-d's "simulate N − 1 before scaling down", in closed form.

The batch slots are sized the same way (`slot_replicas`): a request holds a slot for its time in service h (learned
by Little's law over the replicas, requests in flight over requests finishing: `LittleLaw`), so a rate λ keeps λ·h
slots busy on average, and the fleet needs the fewest replicas of `max_batch` slots for which the chance that a
request waits for a slot longer than the SLO leaves it (the SLO less its prefill) is under what the prefill queue
leaves of the misses allowed at the same count (the two add up; Erlang's C and the M/M/c wait's exponential tail;
arrivals in batches as peaked traffic, Hayward's approximation), the hold taken at the count being sized: fewer
replicas each prefill a larger share of their time and decode slower (`SlotHold`). The rate planned for is the
current one plus one standard deviation of how far it moved over one cold start on this model's traffic, the rate
estimate's own noise taken out (`RateDrift`): replicas ordered now serve the load of a cold start from now. One
deviation was chosen against 2.33 (the 99% quantile) over every trace and shape of `loadtests/sim_matrix.py`: 2.33
bought 1.3-2x the GPU-hours on Azure for no attainment.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from kvgate.registry.schema import ModelDoc

# Where prefill alone uses up most of the goal's misses, the queue may still add this share of it (module docstring).
_QUEUE_SHARE_FLOOR = 0.5
# The lognormal prefill time as this many equally likely points (quantile midpoints): the expectation
# above to within a few percent of its value, at a cost small next to the Erlang recursion.
_POINTS = 48
_UNIT = NormalDist()
_Z = tuple(_UNIT.inv_cdf((i + 0.5) / _POINTS) for i in range(_POINTS))


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """What one replica of the model prefills and how many requests it runs at once, and the SLO its fleet is
    sized for.

    `prefill_tokens_per_s` and `max_batch`: the least over the GPU kinds the model may run on (a replica may land
    on any of them). The prefill rate is the one left beside decode (`prefill_beside_decode`), not the figure
    alone: a busy replica prefills in steps that also decode its batch.
    """

    prefill_tokens_per_s: float
    ttft_slo_s: float
    attainment: float = 0.99
    max_batch: int = 0  # 0: unknown, slots are not sized
    prefill_alone_tokens_per_s: float = 0.0  # the figure itself (no decode beside it); 0: decode never slows

    @classmethod
    def of(cls, model: ModelDoc) -> ReplicaCapacity | None:
        """From the registry: None unless the model has a TTFT SLO and prefill figures for a kind it uses."""
        spec = model.spec
        kinds = [e for e in spec.performance.gpu_kinds if e.gpu_kind in spec.resources.gpu_kinds]
        if spec.slo.ttft_ms is None or not kinds:
            return None
        return cls(prefill_tokens_per_s=min(prefill_beside_decode(e.prefill_tokens_per_s, e.decode_tokens_per_s,
                                                                  e.max_batch or spec.engine.max_running_requests,
                                                                  spec.engine.max_batch_tokens) for e in kinds),
                   ttft_slo_s=spec.slo.ttft_ms / 1000.0, attainment=spec.slo.ttft_attainment,
                   max_batch=min(e.max_batch or spec.engine.max_running_requests for e in kinds),
                   prefill_alone_tokens_per_s=min(e.prefill_tokens_per_s for e in kinds))


def prefill_beside_decode(prefill_tokens_per_s: float, decode_tokens_per_s: float, max_batch: int,
                          max_batch_tokens: int) -> float:
    """Prompt tokens a second a replica prefills while it also decodes: each engine step of `max_batch_tokens`
    (chunked prefill) costs its prefill plus a decode step (max_batch / decode_tokens_per_s, memory-bound).
    burst-8b on an L40S (9,000 prefill and 1,300 decode tokens/s, batch 32, 2,048-token steps): 8,121, 90% of the
    figure. With it the queueing model matches the simulator's engine steps on prefill-heavy traffic at 20
    requests/s (8 replicas: 10.7% of first tokens past the SLO by the model, 10.5% simulated; with the bare
    figure the model said 1.5%)."""
    step_s = max_batch / decode_tokens_per_s
    budget = step_budget(max_batch_tokens, max_batch)
    return prefill_tokens_per_s * budget / (budget + prefill_tokens_per_s * step_s)


def step_budget(max_batch_tokens: int, max_batch: int) -> int:
    """An engine step's token budget: `max_batch_tokens`, with room for a prompt token beside a full batch's
    decodes (the registry allows a budget below the batch)."""
    return max(max_batch_tokens, max_batch + 1)


@dataclass(frozen=True, slots=True)
class PromptLoad:
    """The prompt work arriving: requests/s, and the mean and squared coefficient of variation of their
    uncached prompt tokens (0: all alike)."""

    rate: float
    mean_tokens: float
    c_s2: float = 1.0


@dataclass(frozen=True, slots=True)
class PromptSpread:
    """Decayed sums of arrivals, prompt tokens and their squares: the prompts' c_s^2 over the last several
    minutes. The spread is a property of the workload that moves slowly, and a window of a minute is too
    short for it: its estimate swung between 1.3 and 1.7 from one minute to the next on a steady trace (a
    few long prompts dominate the squares), and in the tail the fleet size is sensitive to it."""

    arrivals: float = 0.0
    tokens: float = 0.0
    squares: float = 0.0
    updated_at: float | None = None

    def add(self, rps: float, tokens_per_s: float, squares_per_s: float, now: float,
            time_constant_s: float = 600.0) -> PromptSpread:
        """Fold in one tick's window rates (their sums decay by e^(-dt / time_constant_s)); a tick at or
        before the last one is ignored."""
        if self.updated_at is not None and now <= self.updated_at:
            return self
        dt = 1.0 if self.updated_at is None else now - self.updated_at
        keep = math.exp(-dt / time_constant_s)
        return PromptSpread(keep * self.arrivals + rps * dt, keep * self.tokens + tokens_per_s * dt,
                            keep * self.squares + squares_per_s * dt, now)

    @property
    def c_s2(self) -> float:
        """The squared coefficient of variation of prompt lengths; 1 before any prompt was counted, or
        when the squares were not reported. Worked: prompts of 1,000 and 3,000 -> mean 2,000, c_s^2 0.25."""
        if self.arrivals <= 0 or self.tokens <= 0 or self.squares <= 0:
            return 1.0
        mean = self.tokens / self.arrivals
        return max(0.0, self.squares / self.arrivals / (mean * mean) - 1.0)


def erlang_c(servers: int, offered: float) -> float:
    """Erlang's C: the probability that an arrival waits in an M/M/c queue with `servers` and `offered`
    load (λ·E[S]); 1.0 when the load is at or past the servers.

    Through Erlang's B recursion, which stays finite for large c. Worked: c=2, a=1 -> 1/3.
    """
    if offered <= 0:
        return 0.0
    if servers <= offered:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1.0 - b))


def ttft_miss(servers: int, load: PromptLoad, capacity: ReplicaCapacity, c_a2: float = 1.0) -> float:
    """P(W + S > SLO) on `servers` replicas (module docstring); 1.0 when they cannot keep up.

    Worked (every prompt alike, c_s^2 0: S = 0.5 s; SLO 1 s; c=2, λ=2/s, c_a^2 1): a = 1, C = 1/3,
    θ = (4 - 2) x 2 / 1 = 4, so 1/3 x e^(-4 x 0.5) = 0.045.
    """
    service_s = load.mean_tokens / capacity.prefill_tokens_per_s
    offered = load.rate * service_s
    if offered <= 0:
        return 0.0
    if servers <= offered:
        return 1.0
    theta = (servers / service_s - load.rate) * 2.0 / (c_a2 + load.c_s2)
    slo = capacity.ttft_slo_s
    wait_odds = erlang_c(servers, offered)
    if load.c_s2 <= 0:
        return 1.0 if service_s > slo else wait_odds * math.exp(-theta * (slo - service_s))
    mu, sigma = _lognormal(service_s, load.c_s2)
    waits = sum(math.exp(-theta * (slo - s)) for s in (math.exp(mu + sigma * z) for z in _Z) if s <= slo)
    return prefill_alone_miss(service_s, load.c_s2, slo) + wait_odds * waits / _POINTS


def _lognormal(mean: float, c2: float) -> tuple[float, float]:
    """The (mu, sigma) of the lognormal with this mean and squared coefficient of variation."""
    sigma = math.sqrt(math.log1p(c2))
    return math.log(mean) - sigma * sigma / 2, sigma


def prefill_alone_miss(service_s: float, c_s2: float, slo_s: float) -> float:
    """The share of requests whose own prefill (lognormal, mean `service_s`) passes the SLO with no wait at all.
    Worked: mean 0.34 s, c_s^2 1.5, SLO 2 s -> sigma 0.96, 0.99%."""
    if c_s2 <= 0:
        return float(service_s > slo_s)
    mu, sigma = _lognormal(service_s, c_s2)
    return 1.0 - _UNIT.cdf((math.log(slo_s) - mu) / sigma)


def miss_budget(capacity: ReplicaCapacity, load: PromptLoad) -> float:
    """The share of requests the fleet may let miss the SLO: the goal's share; where prompts too long to prefill
    within the SLO use most of it, those and half the goal's share on top (module docstring)."""
    allowed = 1.0 - capacity.attainment
    if load.mean_tokens <= 0:
        return allowed
    slow = prefill_alone_miss(load.mean_tokens / capacity.prefill_tokens_per_s, load.c_s2, capacity.ttft_slo_s)
    return slow + max(allowed - slow, _QUEUE_SHARE_FLOOR * allowed)


def prefill_replicas(capacity: ReplicaCapacity, load: PromptLoad, *, c_a2: float = 1.0, limit: int = 10_000) -> int:
    """The fewest replicas whose prefill keeps `load` within the SLO for the attainment goal (module
    docstring); 0 with no load, `limit` when no count below it is enough.

    Worked (burst-8b on L40S: 9,000 tokens/s, SLO 2 s, 99%): 4 requests/s of 3,000-token prompts on average,
    lognormal with c_s^2 1.5 (the prefill-heavy shape's): 0.94% of them miss on prefill alone (over 18,000
    tokens), so the queue may add half the goal's 1%: the budget is 1.44%; 2 replicas miss 5.7%, 3 miss
    1.27%: 3. Were every prompt alike (c_s^2 0), 2 would miss 0.07%: 2.
    """
    if load.rate <= 0 or load.mean_tokens <= 0:
        return 0
    service_s = load.mean_tokens / capacity.prefill_tokens_per_s
    budget = miss_budget(capacity, load)
    servers = max(1, math.floor(load.rate * service_s) + 1)
    while servers < limit and ttft_miss(servers, load, capacity, c_a2) > budget:
        servers += 1
    return servers


# Without a share given (`slot_replicas`'s `allowed_at`), slots get this small share of the goal's misses.
_SLOT_SHARE = 0.1
# A replica never prefills more than this share of its time in the slowdown model (past it, the prefill term has
# long asked for more replicas).
_MAX_PREFILL_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class SlotHold:
    """How long a request holds a batch slot on a fleet of n replicas: its prefill, then its decode, which runs
    slower the larger the share of each replica's time the fleet's prefill takes (engine steps carry prompt chunks
    beside every decode: `prefill_beside_decode`): decode_s / (1 - prefill_load / n).

    The hold is learned by Little's law on the fleet as it ran, so its decode part is read back to full speed with
    the prefill share it was learned at (`learned`). Without that, a count below the running fleet's was sized with
    the running fleet's hold: ramp x10 in the simulator planned 16 replicas with 7.9 s holds for a fleet of 20, and
    the 16, each prefilling a larger share, overflowed their slots within a minute.
    """

    prefill_s: float
    decode_s: float  # the decode part at full speed
    prefill_load: float = 0.0  # replicas' worth of prefill arriving (tokens/s over one replica's prefill alone)

    @classmethod
    def learned(cls, hold_s: float, prefill_s: float, learned_share: float, prefill_load: float = 0.0) -> SlotHold:
        """From a hold learned while each replica prefilled `learned_share` of its time. Worked: 6 s learned at a
        share of 0.5 with 0.2 s of prefill -> 2.9 s of decode at full speed; at a load of 4 replicas' prefill, 8
        replicas hold 6 s again, 5 hold 0.2 + 2.9 / 0.2 = 14.7 s."""
        share = min(_MAX_PREFILL_SHARE, max(0.0, learned_share))
        return cls(min(prefill_s, hold_s), max(0.0, hold_s - prefill_s) * (1.0 - share), prefill_load)

    @classmethod
    def for_load(cls, capacity: ReplicaCapacity, hold_s: float, load: PromptLoad,
                 learned_tokens_per_replica_s: float) -> SlotHold:
        """The hold at the planned `load`, from `hold_s` learned while each replica prefilled
        `learned_tokens_per_replica_s`; `hold_s` itself where the capacity has no prefill figure alone."""
        alone = capacity.prefill_alone_tokens_per_s
        if alone <= 0:
            return cls(hold_s, 0.0)  # nothing known of the prefill: the same hold at every count
        return cls.learned(hold_s, load.mean_tokens / capacity.prefill_tokens_per_s,
                           learned_tokens_per_replica_s / alone, load.rate * load.mean_tokens / alone)

    def at(self, replicas: int) -> float:
        return self.prefill_s + self.decode_s * decode_slowdown(self.prefill_load, replicas)


def decode_slowdown(prefill_load: float, replicas: int) -> float:
    """How many times longer a decode takes on `replicas` sharing `prefill_load` replicas' worth of prefill: each
    spends that share of its time prefilling (at most `_MAX_PREFILL_SHARE`) and decodes in the rest."""
    share = min(_MAX_PREFILL_SHARE, prefill_load / replicas) if replicas > 0 else _MAX_PREFILL_SHARE
    return 1.0 / (1.0 - share)


def slot_replicas(capacity: ReplicaCapacity, rate: float, hold: float | SlotHold, *, slack_s: float = 0.0,
                  c_a2: float = 1.0, limit: int = 10_000, allowed_at: Callable[[int], float] | None = None) -> int:
    """The fewest replicas whose batch slots (`max_batch` each) keep a request waiting for one longer than `slack_s`
    (the SLO less its prefill) to at most `allowed_at(n)` of requests on n replicas (the scaler: what the prefill
    queue leaves of the miss budget at the same n), or a tenth of the goal's misses without it. Each slot is held
    `hold` seconds (on n replicas, `hold.at(n)` for a `SlotHold`; Little's law: rate x hold busy on average); in the
    M/M/c queue over all N slots a request waits with Erlang's C probability, and longer than t with C x exp(-(N -
    busy) t / hold): with many slots one frees often, so a wait is short. 0 with no load or no batch size. The
    concurrency target made from the SLO instead of a fraction of the batch: 32 requests/s held 4.5 s each is 144
    busy slots; with no slack, 5 replicas of 32 (160) leave 13% waiting, 6 (192) 0.008%: 6, where a target of 16 a
    replica asks for 9. With 0.5 s of slack 5 leave 13% x exp(-16 x 0.5 / 4.5) = 2.2% waiting that long: still 6.

    Burstier arrivals (`c_a2`, the index of dispersion) are peaked traffic: requests arriving in batches keep the
    busy count more spread than Poisson arrivals would, by the peakedness z = (1 + c_a^2) / 2. Hayward's
    approximation sizes peaked traffic as Poisson traffic on z times fewer servers and z times less load: C(N / z,
    busy / z), and a tail z times slower (the Allen-Cunneen factor of the module docstring, a hold's squared
    coefficient of variation taken as 1). The Azure conversation trace arrives in batches (c_a^2 about 10): sized
    as Poisson, 15 replicas served 60 requests/s there with 300-520 of their 480 slots busy, and a minute in which
    the prompts grew by half missed the SLO for 865 of its 3,600 requests.
    """
    if not isinstance(hold, SlotHold):
        hold = SlotHold(hold, 0.0)
    if rate <= 0 or capacity.max_batch <= 0 or hold.at(limit) <= 0:
        return 0
    share = _SLOT_SHARE * (1.0 - capacity.attainment)
    peaked = max(1.0, (1.0 + c_a2) / 2.0)
    replicas = max(1, math.floor(rate * hold.at(limit) / capacity.max_batch) + 1)  # the hold is least at most
    while replicas < limit:
        hold_s = hold.at(replicas)
        busy, slots = rate * hold_s, replicas * capacity.max_batch
        tail = (slots - busy) * slack_s / hold_s / peaked
        allowed = share if allowed_at is None else allowed_at(replicas)
        if slots > busy and erlang_c(math.floor(slots / peaked), busy / peaked) * math.exp(-tail) <= allowed:
            break
        replicas += 1
    return replicas


# How many standard deviations of the rate's move over a cold start the scaler plans for (module docstring:
# 2.33, the 99% quantile, bought 1.3-2x the GPU-hours on Azure for no attainment).
DRIFT_SIGMAS = 1.0


@dataclass(frozen=True, slots=True)
class RateDrift:
    """How far the arrival rate moves over one cold start, learned from the rates seen: the fleet ordered now
    serves the load of a cold start from now, so the headroom for it is the spread of that move, measured on
    this model's own traffic rather than chosen for a trace.

    Keeps the rate every `spacing_s` back to the horizon, and a decayed mean of the squared change across it, less
    the part of it that is the rate estimate's own sampling noise (`noise_per_rps`): the scaler feeds the stable
    window's mean, whose variance at a rate r is about c_a^2 x r / window, so a change between two of them carries
    c_a^2 x (r_now + r_then) / window of noise on a rate that never moved. Fed the gateway's 10 s rate with nothing
    subtracted, a steady 4 requests/s of Poisson arrivals carries sqrt(2 x 4 / 10) = 0.9 requests/s of such
    "drift", and decode-heavy traffic in the simulator was planned for 5.3 requests/s where 4.3 arrived.
    """

    points: tuple[tuple[float, float], ...] = ()  # (t, rate), oldest first, `spacing_s` apart
    sq_change: float = 0.0  # decayed mean of (rate(t) - rate(t - horizon))^2
    weight: float = 0.0  # the decayed count behind sq_change

    def add(self, rate: float, now: float, horizon_s: float, *, noise_per_rps: float = 0.0, spacing_s: float = 10.0,
            time_constant_s: float = 3600.0) -> RateDrift:
        """Fold in this tick's rate; the change is measured against the rate one horizon ago, when known, less its
        sampling noise: `noise_per_rps` x (rate now + rate then), the variance of the difference of two
        independent estimates each of variance `noise_per_rps` x its rate."""
        if self.points and now - self.points[-1][0] < spacing_s:
            return self
        sq, weight = self.sq_change, self.weight
        past = [r for t, r in self.points if t <= now - horizon_s]
        if past:
            dt = now - self.points[-1][0]
            keep = math.exp(-dt / time_constant_s)
            weight = keep * weight + 1.0
            sq = sq + ((rate - past[-1]) ** 2 - noise_per_rps * (rate + past[-1]) - sq) / weight
        kept = tuple((t, r) for t, r in self.points if t > now - horizon_s - spacing_s)
        return RateDrift(kept + ((now, rate),), sq, weight)

    def sigma(self) -> float:
        """The standard deviation of the rate's move over the horizon; 0 until one was measured."""
        return math.sqrt(max(0.0, self.sq_change)) if self.weight > 0 else 0.0


@dataclass(frozen=True, slots=True)
class LittleLaw:
    """A request's time in service by Little's law, W = L / lambda, as a ratio of averages: requests running and
    finishing (or arriving, where gateways do not report completions), each averaged over a time constant (the
    scaler's: two stable windows, `autoscaler.demand.HOLD_WINDOWS`) at the ticks that qualify (`learn_hold`).

    The ratio of averages, not the average of per-tick ratios: where the rate jumps (an on/off burst), running
    lags arrivals by a request's time in service, and per-tick ratios at the edges swing from near 0 to many
    times W; over the averages the two edges cancel. Worked: 60 running at 12 rps, then 0 at 0 -> 5 s.

    A hold is trusted once requests have run for five times as long as it is (`settled_hold_s`): a fleet's first
    requests are all running and none has finished yet, so the ratio starts high and falls as h (T - h/2) / (T - h)
    after T seconds: 1.5 x W at T = 2 W, 1.125 x W at 5 W. Trusted at once, it sized the diurnal shape's first
    minute in the simulator at 60 replicas where 15 served, and the scale-down delay kept the fleet at its ceiling
    of 30 for ten minutes.
    """

    running: float = 0.0
    throughput_per_s: float = 0.0
    t: float | None = None
    prompt_tokens_per_replica_s: float = 0.0  # averaged the same way: the prefill each replica did meanwhile
    since: float | None = None  # the first tick with a request running or finishing since the averages were empty

    @property
    def hold_s(self) -> float | None:
        return self.running / self.throughput_per_s if self.throughput_per_s > 0 and self.running > 0 else None

    def settled_hold_s(self, now: float) -> float | None:
        """`hold_s` once requests have run for at least five times its length; None before."""
        hold_s = self.hold_s
        if hold_s is None or self.since is None or now - self.since < 5.0 * hold_s:
            return None
        return hold_s

    def add(self, running: float, throughput_per_s: float, now: float, time_constant_s: float = 300.0,
            prompt_tokens_per_replica_s: float = 0.0) -> LittleLaw:
        # Both averages start from nothing (a first sample counts for one second): the ratio needs no prior.
        dt = 1.0 if self.t is None else now - self.t
        if dt <= 0:
            return self
        keep = math.exp(-dt / time_constant_s)
        return LittleLaw(keep * self.running + (1 - keep) * running,
                         keep * self.throughput_per_s + (1 - keep) * throughput_per_s, now,
                         keep * self.prompt_tokens_per_replica_s + (1 - keep) * prompt_tokens_per_replica_s,
                         self._since(running > 0 or throughput_per_s > 0, now, time_constant_s))

    def _since(self, busy: bool, now: float, time_constant_s: float) -> float | None:
        """When requests started running again: this tick, if busy after averages that hold less than one request
        over their time constant (an idle hour empties them, and the first burst after it reads long again)."""
        empty = self.running < 1.0 / time_constant_s and self.throughput_per_s < 1.0 / time_constant_s
        if self.since is None or empty:
            return now if busy else None
        return self.since
