"""The dashboard's time series: per-model cumulative totals sampled at an interval, the figures of the window
between two samples, and a bounded history of them for the page's two time ranges.

Samples hold cumulative totals, never rates: a rate over any window is the difference of two samples divided by
their time apart, so a late or skipped tick widens one interval instead of losing counts, and a coarser chart is
the same arithmetic over samples further apart (no averaging of averages). TTFT quantiles come from the
difference of two cumulative histograms, interpolated within a bucket as Prometheus' `histogram_quantile` does
(so p99 is only as fine as `router.metrics`' buckets).

The prefix-hit rates divide cached prompt tokens by the gateway's prompt-token *estimate* (characters over the
model's characters per token, which the gateway learns from responses' `usage.prompt_tokens`; 4 until the first
response): predicted tokens are in the same units, realised ones are what the replicas report, so the realised
rate is an approximation while the estimate settles, capped at 1. The realised rate is over the prompts whose
responses reported cached tokens (vLLM does only when run with `--enable-prompt-tokens-details`), and None when
none did: a replica that says nothing is not a 0% hit.

Time ranges and memory. The page offers two ranges, the last 5 minutes and the whole horizon (an hour). Each
range is a ring of samples of its own (`_Range`), sharing the `Sample` objects:
- the short range keeps every sample: 300 s at the default 2 s, 151 samples, 150 chart points;
- the long range keeps one sample per `max(interval_s, horizon_s / MAX_POINTS_PER_RANGE)`: an hour at 10 s,
  361 samples, 360 chart points, plus one trailing point from its newest sample to the newest sample of all, so
  its chart reaches "now".
So an hour costs 482 samples (151 + 361, less the 30 10-s samples of the last 5 minutes, which both rings hold;
each sample is every model's totals) and as many chart points, whatever the traffic: ~5 MiB for 3 models of 3
adapters each. A chart ~600 px wide would gain nothing from the 1,800 points an hour at 2 s would take, and
`/admin/history` stays small enough to poll every 1.5 s: ~9k numbers per model for both ranges (130 kB of JSON
for 3 models), assembled in ~5 ms once per sample and encoded in ~4 ms per poll.

Everything here is synchronous, does no I/O and takes time as an argument (the samples' `now`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.router.metrics import TOKEN_KINDS

# A quantile needs a few observations to mean anything; below this the page shows a dash.
MIN_TTFT_OBSERVATIONS = 1
SHORT_RANGE_S = 300.0  # the page's "last 5 min"
MAX_POINTS_PER_RANGE = 360  # the long range's chart points: an hour at one per 10 s
# Answer codes (`kvgate_router_answers_total{code}`) that count as failed: the gateway's own 5xx refusals (503 no
# capacity, 504 timeout), a replica's 5xx passed through, and a stream that broke after its first byte.
ERROR_CODES = ("5xx", "stream_error")
CLIENT_ERROR_CODE = "4xx"  # refusals of bad input (400, 404, 413, 429 ...) and a replica's 4xx: shown apart


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
    # cumulative, by how requests ended for their clients (kvgate_router_answers_total: 2xx, 4xx, 5xx,
    # stream_error, client_gone), the gateway's refusals included: the error rate's numerator and denominator
    answers: Mapping[str, float] = field(default_factory=dict)
    refused: Mapping[str, float] = field(default_factory=dict)  # cumulative: the gateway's refusals, by reason
    # cumulative: tokens of answers that reported usage, adapter ("" the base model) -> kind -> tokens
    tokens: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # cumulative: requests that reached the proxy, adapter ("" the base model) -> requests
    adapter_requests: Mapping[str, float] = field(default_factory=dict)
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
    answer_rate: float = 0.0  # answers per second, every code
    error_rate: float | None = None  # share of answers that failed (ERROR_CODES); None: no answer in the window
    client_error_rate: float | None = None  # share of answers that were 4xx
    refusal_rates: Mapping[str, float] = field(default_factory=dict)  # per second, by reason (none omitted)
    token_rates: Mapping[str, float] = field(default_factory=dict)  # per second, by kind, all adapters together
    adapter_request_rates: Mapping[str, float] = field(default_factory=dict)  # per second, by adapter
    adapter_token_rates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # adapter -> kind -> /s

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "request_rate": self.request_rate, "ttft_p50_s": self.ttft_p50_s,
                "ttft_p99_s": self.ttft_p99_s, "predicted_hit_rate": self.predicted_hit_rate,
                "realised_hit_rate": self.realised_hit_rate, "decision_rates": dict(self.decision_rates),
                "answer_rate": self.answer_rate, "error_rate": self.error_rate,
                "client_error_rate": self.client_error_rate, "refusal_rates": dict(self.refusal_rates),
                "token_rates": dict(self.token_rates)}


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


def _grew(new: float, old: float) -> float:
    """A counter's growth; below zero (a counter that restarted) counts as zero."""
    return max(new - old, 0.0)


def _rates(newer: Mapping[str, float], older: Mapping[str, float], per_s: float) -> dict[str, float]:
    return {key: _grew(total, older.get(key, 0.0)) * per_s for key, total in newer.items()}


def window_stats(older: ModelTotals, newer: ModelTotals, seconds: float) -> WindowStats:
    """A model's rates between two totals `seconds` apart. Differences below zero (a counter that
    restarted) count as zero. Hit rates are cached tokens over estimated prompt tokens, capped at 1: the
    predicted one over every arriving prompt, the realised one over the prompts whose responses said.
    The error rates are shares of the window's answers: 1 of 40 answers a 503 and 1 a broken stream -> 0.05."""
    per_s = 1.0 / seconds if seconds > 0 else 0.0
    if older.ttft_counts and len(older.ttft_counts) == len(newer.ttft_counts):
        ttft = tuple(_grew(n, o) for n, o in zip(newer.ttft_counts, older.ttft_counts))
    else:
        ttft = newer.ttft_counts
    p50 = histogram_quantile(0.5, newer.ttft_bounds, ttft) if ttft else None
    p99 = histogram_quantile(0.99, newer.ttft_bounds, ttft) if ttft else None
    prompt = _grew(newer.prompt_tokens, older.prompt_tokens)
    predicted = min(_grew(newer.predicted_tokens, older.predicted_tokens) / prompt, 1.0) if prompt else None
    reported = _grew(newer.reported_prompt_tokens, older.reported_prompt_tokens)
    realised = min(_grew(newer.realised_tokens, older.realised_tokens) / reported, 1.0) if reported else None
    answers = _rates(newer.answers, older.answers, 1.0)  # counts in the window
    num_answers = sum(answers.values())
    adapter_tokens = {adapter: _rates(kinds, older.tokens.get(adapter, {}), per_s)
                      for adapter, kinds in newer.tokens.items()}
    return WindowStats(
        seconds=seconds, request_rate=_grew(newer.requests, older.requests) * per_s,
        ttft_p50_s=p50, ttft_p99_s=p99, predicted_hit_rate=predicted, realised_hit_rate=realised,
        decision_rates=_nonzero(_rates(newer.decisions, older.decisions, per_s)),
        answer_rate=num_answers * per_s,
        error_rate=sum(answers.get(code, 0.0) for code in ERROR_CODES) / num_answers if num_answers else None,
        client_error_rate=answers.get(CLIENT_ERROR_CODE, 0.0) / num_answers if num_answers else None,
        refusal_rates=_nonzero(_rates(newer.refused, older.refused, per_s)),
        token_rates={kind: sum(kinds.get(kind, 0.0) for kinds in adapter_tokens.values()) for kind in TOKEN_KINDS},
        adapter_request_rates=_rates(newer.adapter_requests, older.adapter_requests, per_s),
        adapter_token_rates=adapter_tokens)


def _nonzero(rates: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in rates.items() if value > 0}


# ------------------------------------------------------------------------------------ the history


# The figures of one model at one chart point, in this order: the window's (rounded), the later sample's gauges,
# then the window's tokens/s by kind. Computed once, when the point's later sample arrives; `series` only transposes.
_WINDOW_KEYS = ("request_rate", "ttft_p50_s", "ttft_p99_s", "predicted_hit_rate", "realised_hit_rate",
                "error_rate", "client_error_rate")
_GAUGE_KEYS = ("queue_depth", "in_flight", "ready", "desired")
_Row = tuple[Any, ...]
# A model absent from a point's samples: no traffic, no quantile, gauges at ModelTotals' defaults.
_NO_TRAFFIC_ROW: _Row = (0.0, None, None, None, None, None, None, 0, 0, 0, None, *(0.0 for _ in TOKEN_KINDS))
# (wall, {model: (row, decisions/s by reason)}): one chart point, the window between two kept samples
_Point = tuple[float, dict[str, tuple[_Row, dict[str, float]]]]


def _point(older: Sample, newer: Sample) -> _Point:
    seconds = newer.now - older.now
    point = {}
    for name, totals in newer.models.items():
        stats = window_stats(older.models.get(name, ModelTotals()), totals, seconds)
        row = (*(_rounded(getattr(stats, key)) for key in _WINDOW_KEYS), *(getattr(totals, key) for key in _GAUGE_KEYS),
               *(_rounded(stats.token_rates.get(kind, 0.0)) for kind in TOKEN_KINDS))
        point[name] = (row, {reason: _rounded(rate) for reason, rate in stats.decision_rates.items()})
    return newer.wall, point


class _Range:
    """One time range's ring: samples at least `step_s` apart covering `span_s` (+1 sample, so the oldest point
    still has a neighbour to take a rate against), and the chart point of each neighbouring pair, computed once
    when its later sample arrives."""

    def __init__(self, span_s: float, step_s: float, interval_s: float) -> None:
        self.span_s = span_s
        self.step_s = step_s
        # A sample 2.003 s after the last on a 2-s tick is taken; on a 10-s range, the one 9.99 s after is too
        # (half a tick of slack), so the range keeps one per fifth tick instead of drifting to one per sixth.
        self._min_gap_s = 0.0 if step_s <= interval_s else step_s - interval_s / 2
        num_samples = math.ceil(span_s / step_s) + 1
        self.samples: collections.deque[Sample] = collections.deque(maxlen=num_samples)
        self.points: collections.deque[_Point] = collections.deque(maxlen=num_samples - 1)

    def offer(self, sample: Sample) -> None:
        """Keep `sample` if it is `step_s` after the newest kept; one not after the newest replaces it."""
        if self.samples and sample.now <= self.samples[-1].now:
            self.samples.pop()
            if self.samples:
                self.points.pop()
        if self.samples:
            if sample.now - self.samples[-1].now < self._min_gap_s:
                return
            self.points.append(_point(self.samples[-1], sample))
        self.samples.append(sample)


class StatsHistory:
    """Samples for the page's time ranges (see the module docstring): the last `short_range_s` at every
    `interval_s`, and the whole `horizon_s` at one per `max(interval_s, horizon_s / MAX_POINTS_PER_RANGE)`.
    Not thread-safe; one event loop adds and reads.

    Each chart point is computed once, when its later sample arrives, and the assembled `series()` (a
    transposition of the points) is cached until the next sample: a page polling every 1.5 s, or ten of them,
    costs the gateway's event loop only the JSON encoding."""

    def __init__(self, interval_s: float = 2.0, horizon_s: float = 3600.0,
                 short_range_s: float = SHORT_RANGE_S) -> None:
        if interval_s <= 0 or horizon_s < interval_s or short_range_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= horizon_s and short_range_s, got interval {interval_s}, "
                             f"horizon {horizon_s}, short range {short_range_s}")
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        self._ranges = [_Range(min(short_range_s, horizon_s), interval_s, interval_s)]
        if horizon_s > short_range_s:
            self._ranges.append(_Range(horizon_s, max(interval_s, horizon_s / MAX_POINTS_PER_RANGE), interval_s))
        self._series: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self._ranges[0].samples)

    @property
    def samples(self) -> tuple[Sample, ...]:
        """The short range's samples, oldest first: every sample of the last `short_range_s`."""
        return tuple(self._ranges[0].samples)

    @property
    def ranges_s(self) -> tuple[float, ...]:
        """The spans `series` offers, shortest first."""
        return tuple(r.span_s for r in self._ranges)

    @property
    def num_samples_kept(self) -> int:
        """Distinct samples held over all ranges: at most 482 for an hour at 2 s."""
        return len({id(s) for r in self._ranges for s in r.samples})

    def add(self, sample: Sample) -> None:
        """Append `sample`; one not after the newest (a clock that did not move) replaces it."""
        for range_ in self._ranges:
            range_.offer(sample)
        self._series = None

    def latest(self, window_s: float) -> dict[str, WindowStats]:
        """Per model, rates between the newest sample and the newest one at least `window_s` older
        (or the oldest of the short range). Empty until there are two samples."""
        samples = self._ranges[0].samples
        if len(samples) < 2:
            return {}
        newest = samples[-1]
        older = samples[0]
        for sample in reversed(samples):
            if newest.now - sample.now >= window_s:
                older = sample
                break
        seconds = newest.now - older.now
        return {model: window_stats(older.models.get(model, ModelTotals()), totals, seconds)
                for model, totals in newest.models.items()}

    def series(self, range_s: float | None = None) -> dict[str, Any]:
        """The history as JSON for the page's charts: `interval_s`, `horizon_s` and `ranges`, one per time range
        (only the one spanning `range_s` when given; ValueError for a span not offered). A range has `span_s`,
        `step_s`, `t` (wall seconds, one per point) and per model lists aligned with `t`. Point i is the window
        between two kept samples; gauges are the later sample's values. The caller must not modify the result
        (it is cached)."""
        if self._series is None:
            self._series = {"interval_s": self.interval_s, "horizon_s": self.horizon_s,
                            "ranges": [self._assemble(r) for r in self._ranges]}
        if range_s is None:
            return self._series
        for assembled in self._series["ranges"]:
            if assembled["span_s"] == range_s:
                return {**self._series, "ranges": [assembled]}
        raise ValueError(f"no time range of {range_s:g} s; the history offers {', '.join(map(str, self.ranges_s))}")

    def _assemble(self, range_: _Range) -> dict[str, Any]:
        points = list(range_.points)
        newest = self._ranges[0].samples[-1] if self._ranges[0].samples else None
        if newest is not None and newest.now > range_.samples[-1].now:  # the trailing point, up to now
            points.append(_point(range_.samples[-1], newest))
        names = sorted({name for _, point in points for name in point})
        return {"span_s": range_.span_s, "step_s": range_.step_s, "t": [round(wall, 3) for wall, _ in points],
                "models": {name: _model_series(name, points) for name in names}}


def _model_series(name: str, points: list[_Point]) -> dict[str, Any]:
    """One model's lists over `points`: the window figures, the gauges, tokens/s by kind and decisions/s by
    reason (0 at the points without that reason)."""
    rows, decisions = [], []
    for _, point in points:
        row, rates = point.get(name, (_NO_TRAFFIC_ROW, {}))
        rows.append(row)
        decisions.append(rates)
    columns = [list(column) for column in zip(*rows)] if rows else [[] for _ in _NO_TRAFFIC_ROW]
    num_keys = len(_WINDOW_KEYS) + len(_GAUGE_KEYS)
    reasons = sorted({reason for rates in decisions for reason in rates})
    return {**dict(zip((*_WINDOW_KEYS, *_GAUGE_KEYS), columns[:num_keys])),
            "tokens_per_s": dict(zip(TOKEN_KINDS, columns[num_keys:])),
            "decision_rates": {reason: [rates.get(reason, 0.0) for rates in decisions] for reason in reasons}}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
