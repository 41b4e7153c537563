"""The operator dashboard's data: what the gateway samples into its history (`router.stats_history`), and what
`/admin/stats` adds for the page (recent rates, the autoscaler's status record, replica placement).

    every sample_interval_s:  RouterMetrics (cumulative Prometheus series) ─┐
                              WaitQueues depths, tracker ready counts ──────┼─> Sample ─> StatsHistory
                              store "autoscaler"/"status" (desired) ────────┘      (5 min at every sample,
                                                                                     1 h at one per 10 s)
    GET /admin/history  ->  StatsHistory.series(): per time range, one point per kept sample, rates from neighbours
    GET /admin/stats    ->  the router's payload + Dashboard.extend_stats (window rates, errors, tokens per
                            adapter, refusals, autoscaler, pool/node)

The sampler reads the metrics the gateway already keeps (`collect_totals`), never a second tally: requests,
routing decisions, TTFT, prefix tokens, answers by code (the error rate), refusals by reason, tokens by adapter
and kind, and requests per adapter (the tenants' series, whose `model` label is a model or adapter name).

Everything but `Dashboard`'s three coroutines is synchronous and takes time as an argument.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

from kvgate.clock import Clock
from kvgate.log_limit import LogLimiter
from kvgate.state.base import StateStore, StateStoreError
from kvgate.state.records import MALFORMED, AutoscalerStatus, read_status
from kvgate.state.schema import SkippedRecords
from kvgate.router.metrics import TOKEN_KINDS, RouterMetrics
from kvgate.router.queueing import WaitQueues
from kvgate.router.stats_history import ModelTotals, Sample, StatsHistory, WindowStats

log = logging.getLogger("kvgate.router.dashboard")

# ------------------------------------------------------------------------------- reading metrics


def counter_totals(family: Any, *labels: str) -> collections.Counter[tuple[str, ...]]:
    """A counter's `_total` samples summed by the values of `labels`: (model, reason) of the refusals' four."""
    totals: collections.Counter[tuple[str, ...]] = collections.Counter()
    for metric in family.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                totals[tuple(s.labels[label] for label in labels)] += s.value
    return totals


def _by_model(totals: Mapping[tuple[str, ...], float]) -> dict[str, dict[str, float]]:
    """{(model, key): n} as {model: {key: n}}."""
    nested: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for (model, key), value in totals.items():
        nested[model][key] = nested[model].get(key, 0.0) + value
    return nested


def collect_totals(metrics: RouterMetrics, model_names: Iterable[str], prompt_tokens: Mapping[str, float],
                   gauges: Mapping[str, tuple[int, int, int]], desired: Mapping[str, int]) -> dict[str, ModelTotals]:
    """Totals per model from the gateway's Prometheus series (read, not duplicated), plus what the
    metrics lack: `prompt_tokens` (cumulative estimate), `gauges` (queue depth, in flight, ready)
    and the autoscaler's `desired` replicas. Models in `model_names` appear even with no traffic, and so
    does refusals' NO_MODEL ("_unknown": a request naming no declared model) once it has answers.

    Requests per adapter come from `kvgate_router_tenant_requests_total`, whose `model` is the model's name or
    an adapter's; an adapter is attributed to the model whose `kvgate_router_tokens_total` series name it (every
    declared adapter has them from the start, zero-filled), so an adapter's requests show once it is declared."""
    requests: dict[str, float] = collections.Counter()
    predicted: dict[str, float] = collections.Counter()
    realised: dict[str, float] = collections.Counter()
    reported: dict[str, float] = collections.Counter()
    for target, family in ((requests, metrics.requests), (predicted, metrics.prefix_predicted_tokens),
                           (realised, metrics.prefix_realised_tokens),
                           (reported, metrics.prefix_reported_prompt_tokens)):
        for (model,), value in counter_totals(family, "model").items():
            target[model] += value
    decisions = _by_model({key: value for key, value in counter_totals(metrics.decisions, "model", "reason").items()
                           if key[1] != "no_replica"})
    answers = _by_model(counter_totals(metrics.answers, "model", "code"))
    refused = _by_model(counter_totals(metrics.refused_requests, "model", "reason"))
    by_bound: dict[str, collections.Counter[float]] = collections.defaultdict(collections.Counter)
    for metric in metrics.ttft_seconds.collect():  # streamed answers and not, summed
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                by_bound[s.labels["model"]][float(s.labels["le"])] += s.value
    ttft = {model: sorted(bounds.items()) for model, bounds in by_bound.items()}
    for model, retired in metrics.retired_requests.items():  # replicas gone, their series removed
        requests[model] += retired
    names = set(model_names) | set(requests) | set(decisions) | set(ttft) | set(answers) | set(refused)
    tokens, adapter_requests = _per_adapter(metrics, names)
    totals = {}
    for name in sorted(names):
        queue_depth, in_flight, ready = gauges.get(name, (0, 0, 0))
        totals[name] = ModelTotals(
            requests=requests.get(name, 0.0), prompt_tokens=prompt_tokens.get(name, 0.0),
            predicted_tokens=predicted.get(name, 0.0), realised_tokens=realised.get(name, 0.0),
            reported_prompt_tokens=reported.get(name, 0.0),
            ttft_bounds=tuple(le for le, _ in sorted(ttft.get(name, [])) if math.isfinite(le)),
            ttft_counts=tuple(count for _, count in sorted(ttft.get(name, []))),
            decisions=decisions.get(name, {}), answers=answers.get(name, {}), refused=refused.get(name, {}),
            tokens=tokens.get(name, {}), adapter_requests=adapter_requests.get(name, {}),
            queue_depth=queue_depth, in_flight=in_flight, ready=ready, desired=desired.get(name))
    return totals


def _per_adapter(metrics: RouterMetrics, names: set[str]
                 ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, float]]]:
    """model -> adapter ("" the base model) -> kind -> tokens, and model -> adapter -> requests (see
    `collect_totals`: a tenant series' name that is neither a known adapter nor in `names` is skipped)."""
    tokens: dict[str, dict[str, dict[str, float]]] = collections.defaultdict(lambda: collections.defaultdict(dict))
    model_of_adapter: dict[str, str] = {}
    for (model, adapter, kind), value in counter_totals(metrics.tokens, "model", "adapter", "kind").items():
        tokens[model][adapter][kind] = value
        if adapter:
            model_of_adapter[adapter] = model
    requests: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for (name,), value in counter_totals(metrics.tenant_requests, "model").items():
        if name in model_of_adapter:
            requests[model_of_adapter[name]][name] += value
        elif name in names:
            requests[name][""] += value
    return ({model: {adapter: dict(kinds) for adapter, kinds in adapters.items()}
             for model, adapters in tokens.items()},
            {model: dict(adapters) for model, adapters in requests.items()})


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
                 store: StateStore | None = None, sample_interval_s: float = 2.0, history_s: float = 3600.0,
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
        per model `window` (rates over the last `window_s`, null before two samples: `WindowStats.to_json`),
        `requests_total`, `answers_total` (by code), `refused_total` (by reason), `by_adapter`
        (`adapter_breakdown`) and `desired`; per replica `pool`, `node` (null for a static replica) and
        `kv_usage` (0..1, null when the replica reports no KV figures); top level `refused_total` (model ->
        reason -> refusals, NO_MODEL's "_unknown" included), `autoscaler` (the status record or null), `wall`
        and `dashboard` (the history's interval, horizon, time ranges and the window)."""
        status = await self.autoscaler_status()
        placement = await self.placement()
        latest = self.history.latest(self.window_s)
        desired = desired_of(status)
        newest = self.history.samples[-1].models if len(self.history) else {}
        for name, model in payload.get("models", {}).items():
            stats = latest.get(name)
            totals = newest.get(name, ModelTotals())
            model["window"] = stats.to_json() if stats is not None else None
            model["requests_total"] = totals.requests
            model["answers_total"] = dict(totals.answers)
            model["refused_total"] = dict(totals.refused)
            model["by_adapter"] = adapter_breakdown(totals, stats)
            model["desired"] = desired.get(name)
            for replica in model.get("replicas", []):
                pool, node = placement.get(replica["replica_id"], (None, None))
                total = replica.get("kv_blocks_total") or 0
                replica["pool"] = pool
                replica["node"] = node
                replica["kv_usage"] = (round((total - replica["kv_blocks_free"]) / total, 4) if total else None)
        payload["refused_total"] = {name: dict(totals.refused) for name, totals in newest.items() if totals.refused}
        payload["autoscaler"] = None if status is None else status.to_json()
        payload["wall"] = self.clock.wall()
        payload["dashboard"] = {"sample_interval_s": self.history.interval_s, "history_s": self.history.horizon_s,
                                "ranges_s": list(self.history.ranges_s), "window_s": self.window_s}
        return payload


def adapter_breakdown(totals: ModelTotals, stats: WindowStats | None) -> list[dict[str, Any]]:
    """One model's requests and tokens per adapter ("" the base model, first; then by name): totals since the
    gateway started, rates over `stats`' window (null before there is one). 30 requests of "sql" in a 10-s
    window of 50 in all -> request_rate 3.0, requests_total 50."""
    rows = []
    for adapter in sorted(set(totals.adapter_requests) | set(totals.tokens)):
        tokens = totals.tokens.get(adapter, {})
        rows.append({
            "adapter": adapter, "requests_total": totals.adapter_requests.get(adapter, 0.0),
            "tokens_total": {kind: tokens.get(kind, 0.0) for kind in TOKEN_KINDS},
            "request_rate": None if stats is None else round(stats.adapter_request_rates.get(adapter, 0.0), 4),
            "token_rates": None if stats is None else {
                kind: round(stats.adapter_token_rates.get(adapter, {}).get(kind, 0.0), 4) for kind in TOKEN_KINDS}})
    return rows
