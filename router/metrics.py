"""The gateway's Prometheus metrics, in a registry per app (no process-global collectors, so two
gateways in one process, or one per test, never share counts)."""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvgate.exposition import render

if TYPE_CHECKING:
    from kvgate.registry.snapshot import Snapshot

# Routing decisions take microseconds; the buckets reach 10 ms so a slow view build shows up.
_DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 1e-2)
# Time to first token: from 10 ms (a warm prefix hit) to a minute (a cold start behind the queue).
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A whole answer: from a short completion (50 ms) to a long generation behind a cold start (10 min).
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
# Between two streamed tokens: 1 ms (a small model on a GPU) to 2.5 s (a decode stalled behind long prefills).
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# `kvgate_router_answers_total{code}`: how each inference request ended for its client. A stream that broke after
# its first byte went out as 200, so it has a code of its own, as has a client that left before the end.
ANSWER_CODES = ("2xx", "4xx", "5xx", "stream_error", "client_gone")
TOKEN_KINDS = ("prompt", "cached", "completion")
# The `model` of inference requests answered before a registry model resolved (router.refusals.NO_MODEL; a leaf
# here, so that metrics imports nothing of the router).
NO_MODEL = "_unknown"  # `kvgate_router_tokens_total{kind}`, as router.usage counts them


class _Labelled:
    """A labelled metric whose children are looked up once per label values and then kept:
    prometheus_client's `labels()` validates and locks on every call, a few percent of the gateway's
    CPU at thousands of requests a second. Everything else goes to the metric itself."""

    def __init__(self, metric: Counter | Gauge | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):  # noqa: ANN201 - the metric's own child type
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        """Drop one child, from the metric and from the lookup (a kept child would count unexported)."""
        self._children.pop(values, None)
        self._metric.remove(*values)

    def remove_models(self, keep: Collection[str]) -> None:
        """Drop every child whose first label (`model`) is not in `keep`."""
        for values in [values for values in self._children if values[0] not in keep]:
            self.remove(*values)

    def __getattr__(self, name: str) -> object:
        return getattr(self._metric, name)


class ModelHistogram:
    """A histogram with one label, `model`, kept as plain per-bucket counts and exported at each scrape. Observing
    is a bisection, ~0.2 us here, where prometheus_client's `Histogram.observe` takes ~1 us behind its lock: this one
    is observed for every streamed token (`kvgate_router_itl_seconds`). Not thread-safe: the event loop's alone."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(buckets)
        self._children: dict[str, _Counts] = {}

    def labels(self, model: str) -> _Counts:
        child = self._children.get(model)
        if child is None:
            child = self._children[model] = _Counts(self._bounds)
        return child

    def remove_models(self, keep: Collection[str]) -> None:
        for model in [model for model in self._children if model not in keep]:
            del self._children[model]

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model"])]

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        for model, child in sorted(self._children.items()):
            cumulative = list(itertools.accumulate(child.counts))
            buckets = [(floatToGoString(bound), n) for bound, n in zip(self._bounds, cumulative, strict=False)]
            family.add_metric([model], [*buckets, ("+Inf", cumulative[-1])], child.sum)
        return [family]


class _Counts:
    """One model's buckets (the last one past every bound) and sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


class RouterMetrics:
    """Every `kvgate_router_*` series. Label `replica` is the replica's public id ("m-static-0", "kvg-..."), never
    its URL (`router.membership`), and "" for requests that never reached one."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvgate_router_requests", "Upstream attempts and refused requests, by outcome.",
                                ["model", "replica", "outcome"], registry=r)
        self.decisions = Counter("kvgate_router_decisions", "Routing decisions, by reason.",
                                 ["model", "reason"], registry=r)
        self.decision_seconds = Histogram("kvgate_router_decision_seconds", "Time to build the view and choose.",
                                          ["model"], buckets=_DECISION_BUCKETS_S, registry=r)
        # `stream` "false": a non-streamed answer, whose first token reaches the client with its whole body, so its
        # TTFT is its end-to-end time; TTFT SLOs (the alert, the Grafana panel) read streamed answers alone.
        self.ttft_seconds = Histogram("kvgate_router_ttft_seconds",
                                      "Request arrival to the first output token sent to the client, for 2xx answers, "
                                      "streamed (stream=true) or not.", ["model", "stream"], buckets=_TTFT_BUCKETS_S,
                                      registry=r)
        self.prefix_predicted_tokens = Counter("kvgate_router_prefix_predicted_tokens",
                                               "Prompt tokens predicted cached at routing time (estimate).",
                                               ["model"], registry=r)
        self.prefix_realised_tokens = Counter("kvgate_router_prefix_realised_tokens",
                                              "Prompt tokens the replicas reported as cached (cached_tokens).",
                                              ["model"], registry=r)
        # vLLM reports cached_tokens only when run with --enable-prompt-tokens-details: the realised rate is
        # realised over this, never over prompts whose responses said nothing.
        self.prefix_reported_prompt_tokens = Counter(
            "kvgate_router_prefix_reported_prompt_tokens",
            "Prompt tokens of the responses that reported cached_tokens (theirs, else the gateway's estimate).",
            ["model"], registry=r)
        self.answers = Counter("kvgate_router_answers", "Inference requests answered, by how they ended for the "
                               "client: 2xx, 4xx, 5xx (the gateway's refusals included), stream_error (broke "
                               "after the first byte), client_gone.", ["model", "code"], registry=r)
        self.e2e_seconds = Histogram("kvgate_router_e2e_seconds",
                                     "Request arrival to the answer's last byte, for answers a replica gave (2xx).",
                                     ["model"], buckets=_E2E_BUCKETS_S, registry=r)
        # Observed once per streamed token: a histogram of plain counts (`ModelHistogram`), not prometheus_client's.
        self.itl_seconds = ModelHistogram("kvgate_router_itl_seconds",
                                          "Time between two streamed output events (a token each, as engines stream).",
                                          _ITL_BUCKETS_S)
        r.register(self.itl_seconds)
        # `adapter` "" for the base model: per model, sum by (model); per adapter, by (adapter).
        self.tokens = Counter("kvgate_router_tokens", "Tokens of answers that reported usage, by model, adapter "
                              "and kind (prompt, cached of prompt, completion).", ["model", "adapter", "kind"],
                              registry=r)
        self.prefix_estimated_prompt_tokens = Counter(
            "kvgate_router_prefix_estimated_prompt_tokens",
            "Prompt tokens of routed requests, the gateway's estimate: the predicted hit rate's denominator.",
            ["model"], registry=r)
        self.slo_ttft_seconds = Gauge("kvgate_router_slo_ttft_seconds", "Each model's TTFT SLO from the registry "
                                      "(absent for a model without one).", ["model"], registry=r)
        self.state_store_up = Gauge("kvgate_router_state_store_up",
                                    "1 while the gateway's membership polls reach the state store, else 0.",
                                    registry=r)
        self.state_store_up.set(1)
        self.in_flight = Gauge("kvgate_router_in_flight", "Requests between arrival and response end.",
                               ["model"], registry=r)
        self.queue_depth = Gauge("kvgate_router_queue_depth", "Requests waiting for a replica of the model.",
                                 ["model"], registry=r)
        # Set from the tracker at each scrape (`set_replica_counts`): alert on ready == 0, or unlisted > 0 (the
        # replicas' membership records lapsed: is the autoscaler down?).
        self.replicas = Gauge("kvgate_router_replicas", "Replicas the gateway knows, by state: ready, unlisted "
                              "(serving though its membership record lapsed), starting, draining, unhealthy.",
                              ["model", "state"], registry=r)
        self._tenant_series(r)
        self.usage_records_dropped = Counter("kvgate_router_usage_records_dropped",
                                             "Usage-log records dropped as its writer was behind (disk stalled).",
                                             registry=r)
        for name in ("requests", "decisions", "decision_seconds", "ttft_seconds", "prefix_predicted_tokens",
                     "answers", "e2e_seconds", "tokens", "prefix_estimated_prompt_tokens",
                     "slo_ttft_seconds",
                     "prefix_realised_tokens", "prefix_reported_prompt_tokens", "in_flight", "queue_depth",
                     "tenant_requests", "tenant_tokens", "fair_queue_depth", "fair_dispatched"):
            setattr(self, name, _Labelled(getattr(self, name)))
        # Per model, the `requests` counts of replicas whose series were removed (`retire_replicas`), so that
        # totals read from the series (the dashboard's) never go down.
        self.retired_requests: collections.Counter[str] = collections.Counter()
        self._gone_since: dict[str, float] = {}  # replica label -> when it was first seen gone

    def _tenant_series(self, r: CollectorRegistry) -> None:
        """The series with a `tenant` label: refusals, usage and fair queuing."""
        # Every answer the gateway writes itself instead of a replica's, labels bounded by `router.refusals`.
        self.refused_requests = Counter("kvgate_router_refused_requests",
                                        "Requests the gateway refused or failed itself, by reason, status and "
                                        "tenant.", ["model", "reason", "status", "tenant"], registry=r)
        # Usage per tenant (`router.usage`): `tenant` a registry Tenant's name or "_open", `model` a registry model
        # or adapter name, `outcome` one of usage.OUTCOMES, `kind` prompt, cached (of prompt) or completion.
        self.tenant_requests = Counter("kvgate_router_tenant_requests",
                                       "Requests that reached the proxy, by tenant, model or adapter, and outcome.",
                                       ["tenant", "model", "outcome"], registry=r)
        self.tenant_tokens = Counter("kvgate_router_tenant_tokens",
                                     "Tokens of answers that reported usage, by tenant, model or adapter, and kind.",
                                     ["tenant", "model", "kind"], registry=r)
        # Fair queuing (`router.flow_control`): what waits per tenant while a model is saturated, and each tenant's
        # requests sent on through the gate (its share of what was served is its rate over the model's).
        self.fair_queue_depth = Gauge("kvgate_router_fair_queue_depth",
                                      "Requests waiting at the gateway while the model's replicas are saturated.",
                                      ["model", "tenant"], registry=r)
        self.fair_dispatched = Counter("kvgate_router_fair_dispatched",
                                       "Requests sent on through the model's fair queue (at once or after a wait).",
                                       ["model", "tenant"], registry=r)

    def note_registry(self, snapshot: Snapshot) -> None:
        """Give every declared model its per-model series from the start, at zero (a rate or an alert then finds
        a series before the first request), set its TTFT SLO, and drop the series of models no longer declared.
        Called with each registry snapshot."""
        models = snapshot.models
        per_model = (self.e2e_seconds, self.itl_seconds, self.decision_seconds, self.prefix_predicted_tokens,
                     self.prefix_realised_tokens, self.prefix_reported_prompt_tokens,
                     self.prefix_estimated_prompt_tokens, self.in_flight, self.queue_depth)
        for metric in (*per_model, self.ttft_seconds, self.tokens):
            metric.remove_models(models)
        self.answers.remove_models({*models, NO_MODEL})  # refusals before a model resolved are counted as NO_MODEL
        self.slo_ttft_seconds.remove_models({name for name in models if models[name].spec.slo.ttft_ms})
        for code in ANSWER_CODES:
            self.answers.labels(NO_MODEL, code)
        adapters = collections.defaultdict(list)
        for name, adapter in snapshot.adapters.items():
            adapters[adapter.spec.base_model].append(name)
        for name, doc in models.items():
            for metric in per_model:
                metric.labels(name)
            for stream in ("true", "false"):
                self.ttft_seconds.labels(name, stream)
            for code in ANSWER_CODES:
                self.answers.labels(name, code)
            for adapter in ("", *adapters[name]):
                for kind in TOKEN_KINDS:
                    self.tokens.labels(name, adapter, kind)
            if doc.spec.slo.ttft_ms:
                self.slo_ttft_seconds.labels(name).set(doc.spec.slo.ttft_ms / 1000)

    def retire_replicas(self, live: Collection[str], now: float, after_s: float) -> list[str]:
        """Remove the `requests` series of each replica the gateway no longer tracks (not in `live`) once it
        has been gone `after_s`, long enough for scrapes to read its last counts. With an autoscaler replacing
        replicas (spot nodes come and go) the `replica` label would otherwise take new values without end.
        Returns the replicas removed. A replica that comes back starts its series again from 0, which
        Prometheus reads as a counter reset."""
        samples = [(sample.labels, sample.value) for metric in self.requests.collect() for sample in metric.samples
                   if sample.name.endswith("_total") and sample.labels["replica"]]
        gone = {labels["replica"] for labels, _ in samples} - set(live)
        self._gone_since = {rid: since for rid, since in self._gone_since.items() if rid in gone}
        removed = []
        for rid in sorted(gone):
            if now - self._gone_since.setdefault(rid, now) < after_s:
                continue
            for labels, value in samples:
                if labels["replica"] == rid:
                    self.requests.remove(labels["model"], rid, labels["outcome"])
                    self.retired_requests[labels["model"]] += value
            del self._gone_since[rid]
            removed.append(rid)
        return removed

    def set_replica_counts(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Replace the `kvgate_router_replicas` series with `counts` ((model, state) -> replicas)."""
        self.replicas.clear()
        for (model, state), n in counts.items():
            self.replicas.labels(model, state).set(n)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, without `_created` series."""
        return render(self.registry)

