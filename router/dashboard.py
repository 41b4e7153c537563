"""The operator dashboard's data: a bounded time-series history kept by the gateway, and what
`/admin/stats` adds for the page (recent rates, the autoscaler's status record, replica placement).

    every sample_interval_s:  RouterMetrics (cumulative Prometheus series) ─┐
                              WaitQueues depths, tracker ready counts ──────┼─> Sample ─> StatsHistory
                              store "autoscaler"/"status" (desired) ────────┘      (ring, horizon_s)
    GET /admin/history  ->  StatsHistory.series(): one point per interval, rates from neighbouring samples
    GET /admin/stats    ->  the router's payload + Dashboard.extend_stats (window rates, autoscaler, pool/node)

Samples hold cumulative totals, never rates: a rate over any window is the difference of two samples
divided by their time apart, so a late or skipped tick widens one interval instead of losing counts.
TTFT quantiles come from the difference of two cumulative histograms, interpolated within a bucket as
Prometheus' `histogram_quantile` does (so p99 is only as fine as `router.metrics`' buckets).

The prefix-hit rates divide cached prompt tokens by the gateway's prompt-token *estimate* (characters
over the model's characters per token, which the gateway learns from responses' `usage.prompt_tokens`;
4 until the first response): predicted tokens are in the same units, realised ones are what the
replicas report, so the realised rate is an approximation while the estimate settles, capped at 1. The
realised rate is over the prompts whose responses reported cached tokens (vLLM does only when run with
`--enable-prompt-tokens-details`), and None when none did: a replica that says nothing is not a 0% hit.

Everything but `Dashboard`'s three coroutines is synchronous and takes time as an argument.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kvgate.clock import Clock
from kvgate.log_limit import LogLimiter
from kvgate.state.base import StateStore, StateStoreError
from kvgate.state.records import MALFORMED, AutoscalerStatus, read_status
from kvgate.state.schema import SkippedRecords
from kvgate.router.metrics import RouterMetrics
from kvgate.router.queueing import WaitQueues

log = logging.getLogger("kvgate.router.dashboard")

# A quantile needs a few observations to mean anything; below this the page shows a dash.
MIN_TTFT_OBSERVATIONS = 1


# ------------------------------------------------------------------------------------ value types


@dataclass(frozen=True)
class ModelTotals:
    """One model's counters at one instant. Cumulative fields only grow (while the gateway runs);
    gauges are the value at the instant."""

    requests: float = 0.0  # cumulative: answered attempts and refusals (kvgate_router_requests_total)
    prompt_tokens: float = 0.0  # cumulative: estimated prompt tokens of arriving requests
    predicted_tokens: float = 0.0  # cumulative: prompt tokens predicted cached at routing time
    realised_tokens: float = 0.0  # cumulative: cached_tokens the replicas reported
    reported_prompt_tokens: float = 0.0  # cumulative: estimated prompt tokens of the responses that reported them
    ttft_bounds: tuple[float, ...] = ()  # the TTFT histogram's finite bucket upper bounds, seconds
    ttft_counts: tuple[float, ...] = ()  # cumulative histogram counts, one per bound and +Inf last
    decisions: Mapping[str, float] = field(default_factory=dict)  # cumulative, by reason
    queue_depth: int = 0  # gauge: requests waiting for a replica
    in_flight: int = 0  # gauge: requests between arrival and response end
    ready: int = 0  # gauge: routable replicas
    desired: int | None = None  # gauge: the autoscaler's desired replicas; None without an autoscaler


@dataclass(frozen=True)
class Sample:
    """Every model's totals at `now` (the clock's monotonic seconds; `wall` for display)."""

    now: float
    wall: float
    models: Mapping[str, ModelTotals]


@dataclass(frozen=True)
class WindowStats:
    """One model's figures over the window between two samples."""

    seconds: float  # width of the window
    request_rate: float  # per second
    ttft_p50_s: float | None  # None: no first byte in the window
    ttft_p99_s: float | None
    predicted_hit_rate: float | None  # None: no prompt tokens in the window
    realised_hit_rate: float | None
    decision_rates: Mapping[str, float]  # per second, by reason (reasons with none omitted)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "request_rate": self.request_rate, "ttft_p50_s": self.ttft_p50_s,
                "ttft_p99_s": self.ttft_p99_s, "predicted_hit_rate": self.predicted_hit_rate,
                "realised_hit_rate": self.realised_hit_rate, "decision_rates": dict(self.decision_rates)}


# ---------------------------------------------------------------------------------- pure figures


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The q-quantile (0 < q < 1) of a cumulative histogram, linear within the bucket it falls in, as
    Prometheus' `histogram_quantile`. `bounds` are the finite upper bounds in order; `counts` has one
    more entry (the +Inf bucket, i.e. the total). A quantile in the +Inf bucket returns the largest
    finite bound (all we know is "above it"). None when the histogram is empty.

    Worked example: bounds (0.1, 0.5), counts (2, 8, 10): p50 -> rank 5, in (0.1, 0.5] holding ranks
    2..8 -> 0.1 + 0.4 * (5 - 2) / 6 = 0.3."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"{len(counts)} counts for {len(bounds)} finite bounds; expected one more (+Inf)")
    total = counts[-1]
    if total < MIN_TTFT_OBSERVATIONS:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            in_bucket = count - lower_count
            if in_bucket <= 0:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / in_bucket
        lower_bound, lower_count = bound, count
    return bounds[-1] if bounds else None


def window_stats(older: ModelTotals, newer: ModelTotals, seconds: float) -> WindowStats:
    """A model's rates between two totals `seconds` apart. Differences below zero (a counter that
    restarted) count as zero. Hit rates are cached tokens over estimated prompt tokens, capped at 1: the
    predicted one over every arriving prompt, the realised one over the prompts whose responses said."""
    def grew(new: float, old: float) -> float:
        return max(new - old, 0.0)

    per_s = 1.0 / seconds if seconds > 0 else 0.0
    if older.ttft_counts and len(older.ttft_counts) == len(newer.ttft_counts):
        ttft = tuple(grew(n, o) for n, o in zip(newer.ttft_counts, older.ttft_counts))
    else:
        ttft = newer.ttft_counts
    p50 = histogram_quantile(0.5, newer.ttft_bounds, ttft) if ttft else None
    p99 = histogram_quantile(0.99, newer.ttft_bounds, ttft) if ttft else None
    prompt = grew(newer.prompt_tokens, older.prompt_tokens)
    predicted = min(grew(newer.predicted_tokens, older.predicted_tokens) / prompt, 1.0) if prompt else None
    reported = grew(newer.reported_prompt_tokens, older.reported_prompt_tokens)
    realised = min(grew(newer.realised_tokens, older.realised_tokens) / reported, 1.0) if reported else None
    decisions = {reason: grew(total, older.decisions.get(reason, 0.0)) * per_s
                 for reason, total in newer.decisions.items()}
    return WindowStats(seconds=seconds, request_rate=grew(newer.requests, older.requests) * per_s,
                       ttft_p50_s=p50, ttft_p99_s=p99, predicted_hit_rate=predicted, realised_hit_rate=realised,
                       decision_rates={r: v for r, v in decisions.items() if v > 0})


class StatsHistory:
    """A ring of samples covering the last `horizon_s` at one per `interval_s` (600 s at 2 s: 301
    samples, the +1 so the oldest point still has a neighbour to take a rate against). Not thread-safe;
    one event loop adds and reads.

    Each chart point (the window between two neighbouring samples) is computed once, when its later
    sample arrives, and the assembled `series()` is cached until the next sample: a page polling every
    1.5 s, or ten of them, costs the gateway's event loop only the JSON encoding."""

    def __init__(self, interval_s: float = 2.0, horizon_s: float = 600.0) -> None:
        if interval_s <= 0 or horizon_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= horizon_s, got interval {interval_s}, horizon {horizon_s}")
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        num_samples = math.ceil(horizon_s / interval_s) + 1
        self._samples: collections.deque[Sample] = collections.deque(maxlen=num_samples)
        # (wall, {model: (window stats, the later sample's totals)}), one per neighbouring pair of samples
        self._points: collections.deque[tuple[float, dict[str, tuple[WindowStats, ModelTotals]]]] = \
            collections.deque(maxlen=num_samples - 1)
        self._series: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)

    def add(self, sample: Sample) -> None:
        """Append `sample`; one not after the newest (a clock that did not move) replaces it."""
        if self._samples and sample.now <= self._samples[-1].now:
            self._samples.pop()
            if self._points and len(self._samples) >= 1:
                self._points.pop()
        if self._samples:
            old = self._samples[-1]
            seconds = sample.now - old.now
            self._points.append((sample.wall, {
                name: (window_stats(old.models.get(name, ModelTotals()), totals, seconds), totals)
                for name, totals in sample.models.items()}))
        self._samples.append(sample)
        self._series = None

    def latest(self, window_s: float) -> dict[str, WindowStats]:
        """Per model, rates between the newest sample and the newest one at least `window_s` older
        (or the oldest there is). Empty until there are two samples."""
        if len(self._samples) < 2:
            return {}
        newest = self._samples[-1]
        older = self._samples[0]
        for sample in reversed(self._samples):
            if newest.now - sample.now >= window_s:
                older = sample
                break
        seconds = newest.now - older.now
        return {model: window_stats(older.models.get(model, ModelTotals()), totals, seconds)
                for model, totals in newest.models.items()}

    def series(self) -> dict[str, Any]:
        """The history as JSON for the page's charts: `t` (wall seconds, one per point) and per model
        lists aligned with it. Point i is the window from sample i to sample i+1; gauges are sample
        i+1's values. N samples give N-1 points. The caller must not modify the result (it is cached)."""
        if self._series is None:
            self._series = self._assemble()
        return self._series

    def _assemble(self) -> dict[str, Any]:
        names = sorted({name for _, point in self._points for name in point})
        models: dict[str, dict[str, Any]] = {}
        for name in names:
            rows: dict[str, list[Any]] = {key: [] for key in (*_WINDOW_KEYS, *_GAUGE_KEYS)}
            decisions: dict[str, list[float | None]] = {}
            for i, (_, point) in enumerate(self._points):
                stats, totals = point.get(name, (_NO_TRAFFIC, ModelTotals()))
                for key in _WINDOW_KEYS:
                    rows[key].append(_rounded(getattr(stats, key)))
                for key in _GAUGE_KEYS:
                    rows[key].append(getattr(totals, key))
                for reason in stats.decision_rates:
                    decisions.setdefault(reason, [0.0] * i)
                for reason, row in decisions.items():
                    row.append(_rounded(stats.decision_rates.get(reason, 0.0)))
            models[name] = {**rows, "decision_rates": decisions}
        return {"interval_s": self.interval_s, "horizon_s": self.horizon_s,
                "t": [round(wall, 3) for wall, _ in self._points], "models": models}


_WINDOW_KEYS = ("request_rate", "ttft_p50_s", "ttft_p99_s", "predicted_hit_rate", "realised_hit_rate")
_GAUGE_KEYS = ("queue_depth", "in_flight", "ready", "desired")
_NO_TRAFFIC = WindowStats(seconds=0.0, request_rate=0.0, ttft_p50_s=None, ttft_p99_s=None, predicted_hit_rate=None,
                          realised_hit_rate=None, decision_rates={})


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# ------------------------------------------------------------------------------- reading metrics


def collect_totals(metrics: RouterMetrics, model_names: Iterable[str], prompt_tokens: Mapping[str, float],
                   gauges: Mapping[str, tuple[int, int, int]], desired: Mapping[str, int]) -> dict[str, ModelTotals]:
    """Totals per model from the gateway's Prometheus series (read, not duplicated), plus what the
    metrics lack: `prompt_tokens` (cumulative estimate), `gauges` (queue depth, in flight, ready)
    and the autoscaler's `desired` replicas. Models in `model_names` appear even with no traffic."""
    requests: dict[str, float] = collections.Counter()
    predicted: dict[str, float] = collections.Counter()
    realised: dict[str, float] = collections.Counter()
    reported: dict[str, float] = collections.Counter()
    decisions: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for target, family in ((requests, metrics.requests), (predicted, metrics.prefix_predicted_tokens),
                           (realised, metrics.prefix_realised_tokens),
                           (reported, metrics.prefix_reported_prompt_tokens)):
        for metric in family.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    target[s.labels["model"]] += s.value
    for metric in metrics.decisions.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels["reason"] != "no_replica":
                decisions[s.labels["model"]][s.labels["reason"]] = s.value
    ttft: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for metric in metrics.ttft_seconds.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                ttft[s.labels["model"]].append((float(s.labels["le"]), s.value))
    for model, retired in metrics.retired_requests.items():  # replicas gone, their series removed
        requests[model] += retired
    names = set(model_names) | set(requests) | set(decisions) | set(ttft)
    totals = {}
    for name in sorted(names):
        queue_depth, in_flight, ready = gauges.get(name, (0, 0, 0))
        totals[name] = ModelTotals(
            requests=requests.get(name, 0.0), prompt_tokens=prompt_tokens.get(name, 0.0),
            predicted_tokens=predicted.get(name, 0.0), realised_tokens=realised.get(name, 0.0),
            reported_prompt_tokens=reported.get(name, 0.0),
            ttft_bounds=tuple(le for le, _ in sorted(ttft.get(name, [])) if math.isfinite(le)),
            ttft_counts=tuple(count for _, count in sorted(ttft.get(name, []))),
            decisions=dict(decisions.get(name, {})), queue_depth=queue_depth, in_flight=in_flight, ready=ready,
            desired=desired.get(name))
    return totals


def gauge_values(gauge: Any) -> dict[str, float]:
    """A gauge labelled by model, as {model: value}."""
    return {s.labels["model"]: s.value for metric in gauge.collect() for s in metric.samples}


def desired_of(status: AutoscalerStatus | None) -> dict[str, int]:
    """Desired replicas per model from the autoscaler's status record ({} without one)."""
    return {} if status is None else {name: m.desired for name, m in status.models.items()}


def dashboard_page() -> str:
    """The page's HTML (router/dashboard_page.html, shipped as package data): inline CSS, JS and SVG."""
    return resources.files("kvgate.router").joinpath("dashboard_page.html").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------ the shell


class Dashboard:
    """The gateway's dashboard state: the history, the prompt-token tally the metrics lack, and the
    readers of the state store. Owned by the app (`build_app`), one per gateway.

    `ready_count(model)` is the tracker's `num_ready`; `model_names()` lists the registry's models now.
    With `store` None there is no autoscaler to read: `/admin/stats` says `"autoscaler": null`."""

    def __init__(self, *, metrics: RouterMetrics, queues: WaitQueues, clock: Clock,
                 ready_count: Callable[[str], int], model_names: Callable[[], Iterable[str]],
                 store: StateStore | None = None, sample_interval_s: float = 2.0, history_s: float = 600.0,
                 window_s: float = 10.0) -> None:
        self.metrics = metrics
        self.queues = queues
        self.clock = clock
        self.store = store
        self._skipped = SkippedRecords(log)  # a status record of a newer release: said once
        self._read_errors = LogLimiter()  # a broken record or an unexpected error: a line a minute per kind
        self.window_s = window_s
        self._ready_count = ready_count
        self._model_names = model_names
        self.history = StatsHistory(sample_interval_s, history_s)
        self._prompt_tokens: collections.Counter[str] = collections.Counter()

    def note_request(self, model: str, estimated_prompt_tokens: int) -> None:
        """Count one arriving request's estimated prompt tokens (the hit rates' denominator)."""
        self._prompt_tokens[model] += estimated_prompt_tokens

    # ---- sampling

    def take_sample(self, autoscaler: AutoscalerStatus | None) -> Sample:
        """Read every total now and add the sample to the history (synchronous: no await inside)."""
        names = list(self._model_names())
        in_flight = gauge_values(self.metrics.in_flight)
        gauges = {name: (self.queues.depth(name), int(in_flight.get(name, 0)), self._ready_count(name))
                  for name in names}
        totals = collect_totals(self.metrics, names, self._prompt_tokens, gauges, desired_of(autoscaler))
        sample = Sample(now=self.clock.now(), wall=self.clock.wall(), models=totals)
        self.history.add(sample)
        return sample

    async def run_sampler(self) -> None:
        """Sample every `interval_s` until cancelled. A failing store read leaves `desired` unknown
        for that sample, never stops the loop."""
        while True:
            status = await self.autoscaler_status()
            self.take_sample(status)
            await self.clock.sleep(self.history.interval_s)

    async def autoscaler_status(self) -> AutoscalerStatus | None:
        """The autoscaler's status record, or None (no store, no record, store down, a record that does not
        parse, or one of a newer release: said once)."""
        if self.store is None:
            return None
        try:
            return await read_status(self.store, self._skipped)
        except StateStoreError as exc:  # the membership poll logs the outage once a second; this adds nothing
            log.debug("reading the autoscaler status failed: %s", exc)
            return None
        except MALFORMED as exc:  # a broken record: the page says "no autoscaler"
            verdict = self._read_errors.hit("status", self.clock.now())
            if verdict is not None:
                log.warning("the autoscaler status record does not parse: %r%s", exc, verdict.note)
            return None

    async def placement(self) -> dict[str, tuple[str | None, str | None]]:
        """replica_id -> (pool, node_id) from the store's membership records; {} without a store."""
        if self.store is None:
            return {}
        try:
            members = await self.store.list_members()
        except StateStoreError as exc:  # logged by the membership poll, as above
            log.debug("reading membership for the dashboard failed: %s", exc)
            return {}
        except Exception as exc:
            verdict = self._read_errors.hit(type(exc), self.clock.now())
            if verdict is not None:  # the traceback once: the same bug's again would say nothing new
                log.warning("reading membership for the dashboard failed: %r%s", exc, verdict.note,
                            exc_info=verdict.first)
            return {}
        return {m.replica_id: (m.pool, m.node_id) for m in members}

    # ---- /admin/stats

    async def extend_stats(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Add the dashboard's fields to the router's `/admin/stats` payload, in place, and return it:
        per model `window` (rates over the last `window_s`, null before two samples), `requests_total`
        and `desired`; per replica `pool`, `node` (null for a static replica) and `kv_usage` (0..1,
        null when the replica reports no KV figures); top level `autoscaler` (the status record or
        null), `wall` and `dashboard` (the history's interval and horizon)."""
        status = await self.autoscaler_status()
        placement = await self.placement()
        latest = self.history.latest(self.window_s)
        desired = desired_of(status)
        for name, model in payload.get("models", {}).items():
            stats = latest.get(name)
            model["window"] = stats.to_json() if stats is not None else None
            newest = self.history.samples[-1].models.get(name) if len(self.history) else None
            model["requests_total"] = newest.requests if newest is not None else 0.0
            model["desired"] = desired.get(name)
            for replica in model.get("replicas", []):
                pool, node = placement.get(replica["replica_id"], (None, None))
                total = replica.get("kv_blocks_total") or 0
                replica["pool"] = pool
                replica["node"] = node
                replica["kv_usage"] = (round((total - replica["kv_blocks_free"]) / total, 4) if total else None)
        payload["autoscaler"] = None if status is None else status.to_json()
        payload["wall"] = self.clock.wall()
        payload["dashboard"] = {"sample_interval_s": self.history.interval_s, "history_s": self.history.horizon_s,
                                "window_s": self.window_s}
        return payload
