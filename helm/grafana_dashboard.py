#!/usr/bin/env python3
"""Writes kvgate's Grafana dashboard, helm/kvgate/files/grafana-dashboard.json, from the panels below.

    python helm/grafana_dashboard.py           # (re)write the JSON
    python helm/grafana_dashboard.py --check   # exit 1 if the committed JSON is not what this script writes

The JSON is committed: the chart ships it in a ConfigMap for Grafana's dashboard sidecar
(grafanaDashboard.enabled) and it can be imported by hand. Edit this script, never the JSON;
tests/observability/test_grafana_dashboard.py fails on a stale file.

Every query aggregates across gateway pods, which export the same series side by side: counters are
summed as rates, histograms are summed by bucket before histogram_quantile, ratios are sums over sums,
and gauges every gateway reports alike (replica counts, the autoscaler's series) take max, never sum.
Variables: $datasource (a Prometheus), $model (label_values(kvgate_router_in_flight, model), several or
All) and Grafana's $__rate_interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent / "kvgate" / "files" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
MODEL = 'model=~"$model"'
# Refusals before a model resolved (bad JSON, a model the registry does not declare) carry model "_unknown".
MODEL_OR_UNKNOWN = 'model=~"$model|_unknown"'
# Engines export no model label of their own; the chart's PodMonitor adds one from the pod's kvgate.io/model
# label. An engine scraped without it (a hand-written scrape config) shows under every model.
ENGINE_MODEL = 'model=~"$model|"'
WIDTH = 24  # Grafana's grid is 24 columns wide
HEIGHT = 8


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # a Grafana unit id: reqps, s, percentunit, short, currencyUSD, or "suffix:..." for a custom one
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "stat": one number per query
    width: int = 12
    stacked: bool = False


def rate(metric: str, selector: str = MODEL, by: str = "model") -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}{RATE}))"


def quantiles(metric: str, selector: str = MODEL) -> tuple[Query, ...]:
    """p50, p90 and p99 of a histogram, per model, from buckets summed over gateways."""
    return tuple(
        Query(f"histogram_quantile({q}, sum by (le, model) (rate({metric}_bucket{{{selector}}}{RATE})))",
              f"p{round(q * 100)} {{{{model}}}}")
        for q in (0.5, 0.9, 0.99))


def ratio(numerator: str, denominator: str, numerator_selector: str = MODEL) -> str:
    """Per model, the sum over gateways of one rate over the sum of another (never an average of ratios)."""
    return f"{rate(numerator, numerator_selector)}\n/\n{rate(denominator)}"


# The base model's series have adapter "" (no label): name them "(base)" in the legend.
BASE_AS_ADAPTER = 'label_replace(\n  {},\n  "adapter", "(base)", "adapter", ""\n)'


TRAFFIC = [
    Panel("Requests by model", "reqps", "Inference requests answered per second, per model, whatever their outcome.",
          (Query(rate("kvgate_router_answers_total"), "{{model}}"),), stacked=True),
    Panel("Requests by outcome", "reqps",
          "Inference requests answered per second, by how they ended for the client (kvgate_router_answers_total): "
          "2xx, 4xx, 5xx (the gateway's own refusals included), stream_error (broke after the first byte), "
          "client_gone.",
          (Query(rate("kvgate_router_answers_total", by="code"), "{{code}}"),), stacked=True),
    Panel("Error ratio", "percentunit",
          "Share of answers that failed the client: 5xx plus streams broken after their first byte (alert "
          "KvgateServerErrorRatioHigh at 5 %), and the gateway's own 4xx refusals.",
          (Query(ratio("kvgate_router_answers_total", "kvgate_router_answers_total", f'code=~"5xx|stream_error", {MODEL}'),
                 "5xx + stream_error {{model}}"),
           Query(ratio("kvgate_router_answers_total", "kvgate_router_answers_total", f'code="4xx", {MODEL}'),
                 "4xx {{model}}")), width=8),
    Panel("Refused by the gateway", "reqps",
          "Answers the gateway wrote itself instead of a replica's, by reason and status "
          "(kvgate_router_refused_requests_total). Model \"_unknown\": refused before a model resolved.",
          (Query(rate("kvgate_router_refused_requests_total", MODEL_OR_UNKNOWN, by="reason, status"),
                 "{{reason}} ({{status}})"),), stacked=True, width=8),
    Panel("Upstream attempts by outcome", "reqps",
          "Attempts to reach a replica, by outcome (kvgate_router_requests_total): success, upstream_4xx/5xx, "
          "timeout, connect_error, broken_body, ... A request retried elsewhere counts once per attempt.",
          (Query(rate("kvgate_router_requests_total", by="outcome"), "{{outcome}}"),), stacked=True, width=8),
]

LATENCY = [
    Panel("Time to first token (streamed)", "s",
          "Request arrival at the gateway to the first output token sent to the client, for streamed answers "
          "(a non-streamed answer's first token comes with its whole body: see End-to-end latency), with the "
          "model's TTFT SLO from the registry (no line for a model without one).",
          quantiles("kvgate_router_ttft_seconds", f'stream="true", {MODEL}')
          + (Query(f"max by (model) (kvgate_router_slo_ttft_seconds{{{MODEL}}})", "SLO {{model}}"),)),
    Panel("Inter-token latency", "s",
          "Time between two streamed output events at the gateway (kvgate_router_itl_seconds).",
          quantiles("kvgate_router_itl_seconds")),
    Panel("End-to-end latency", "s",
          "Request arrival to the answer's last byte, for answers a replica gave (kvgate_router_e2e_seconds).",
          quantiles("kvgate_router_e2e_seconds")),
    Panel("Routing decision time", "s",
          "Time to build the replica view and choose (kvgate_router_decision_seconds).",
          quantiles("kvgate_router_decision_seconds")),
]

CACHE_AND_TOKENS = [
    Panel("Prefix-hit rate: predicted vs realised", "percentunit",
          "Predicted: prompt tokens the router expected cached when it chose a replica, over its estimate of the "
          "prompt tokens. Realised: tokens the replicas reported cached (cached_tokens), over the prompt tokens "
          "of the answers that reported it. Realised far below predicted: alert KvgatePrefixHitRateBelowPredicted.",
          (Query(ratio("kvgate_router_prefix_predicted_tokens_total", "kvgate_router_prefix_estimated_prompt_tokens_total"),
                 "predicted {{model}}"),
           Query(ratio("kvgate_router_prefix_realised_tokens_total", "kvgate_router_prefix_reported_prompt_tokens_total"),
                 "realised {{model}}"))),
    Panel("Tokens per second by kind", "suffix: tok/s",
          "Tokens of answers that reported usage (kvgate_router_tokens_total): prompt, cached (the part of the "
          "prompt the replica had cached) and completion.",
          (Query(rate("kvgate_router_tokens_total", by="kind"), "{{kind}}"),)),
    Panel("Tokens per second by adapter", "suffix: tok/s",
          "Prompt and completion tokens per LoRA adapter; \"(base)\" is the base model without an adapter.",
          (Query(BASE_AS_ADAPTER.format(rate("kvgate_router_tokens_total", f'kind=~"prompt|completion", {MODEL}',
                                             by="adapter")), "{{adapter}}"),),
          stacked=True),
    Panel("Tokens per second by tenant", "suffix: tok/s",
          "Prompt and completion tokens per tenant (kvgate_router_tenant_tokens_total; \"_open\" on a gateway "
          "without tenants). Its model label is the model or adapter the request named.",
          (Query(rate("kvgate_router_tenant_tokens_total", 'kind=~"prompt|completion"', by="tenant"), "{{tenant}}"),),
          stacked=True),
]

CAPACITY = [
    Panel("Replicas: desired vs ready", "short",
          "The active autoscaler's desired and ready (and starting) replicas per model, and the ready replicas "
          "the gateways see (max over gateways: each reports the whole fleet).",
          (Query(f"max by (model) (kvgate_autoscaler_replicas_desired{{{MODEL}}})", "desired {{model}}"),
           Query(f'max by (model) (kvgate_autoscaler_replicas{{state="ready", {MODEL}}})', "ready (autoscaler) {{model}}"),
           Query(f'max by (model) (kvgate_autoscaler_replicas{{state="starting", {MODEL}}})',
                 "starting (autoscaler) {{model}}"),
           Query(f'max by (model) (kvgate_router_replicas{{state="ready", {MODEL}}})', "ready (gateway) {{model}}"))),
    Panel("Queue depth and requests in flight", "short",
          "Requests waiting at the gateways for a replica (kvgate_router_queue_depth; held during a scale from "
          "zero) and requests between arrival and the end of their answer, summed over gateways.",
          (Query(f"sum by (model) (kvgate_router_queue_depth{{{MODEL}}})", "waiting {{model}}"),
           Query(f"sum by (model) (kvgate_router_in_flight{{{MODEL}}})", "in flight {{model}}"))),
    Panel("Node cost per hour by pool", "currencyUSD",
          "What the nodes the autoscaler holds cost, in US dollars per hour, by pool "
          "(kvgate_autoscaler_node_cost_usd_per_hour).",
          (Query("max by (pool) (kvgate_autoscaler_node_cost_usd_per_hour)", "{{pool}}"),), stacked=True, width=8),
    Panel("Nodes by pool and state", "short",
          "The autoscaler's nodes by pool, capacity type (spot, on_demand) and state (pending, running, "
          "interrupted, terminating).",
          (Query("max by (pool, capacity_type, state) (kvgate_autoscaler_nodes)", "{{pool}} {{capacity_type}} {{state}}"),),
          width=8),
    Panel("Oldest node still provisioning", "s",
          "Per pool, the age of the oldest node still pending or claim not yet a node, 0 when none "
          "(kvgate_autoscaler_provisioning_oldest_seconds); past 20 minutes fires KvgateNodeProvisioningStuck.",
          (Query("max by (pool) (kvgate_autoscaler_provisioning_oldest_seconds)", "{{pool}}"),), width=8),
]

ENGINES = [
    Panel("Engine KV cache usage", "percentunit",
          "Share of each engine's KV blocks in use (kvgate_engine_kv_blocks_*; free blocks include reclaimable "
          "cached ones), per engine.",
          (Query(f"1 - sum by (model, instance) (kvgate_engine_kv_blocks_free{{{ENGINE_MODEL}}})\n"
                 f"/ sum by (model, instance) (kvgate_engine_kv_blocks_total{{{ENGINE_MODEL}}})",
                 "{{model}} {{instance}}"),), width=8),
    Panel("Engine requests waiting and running", "short",
          "Requests queued in each engine's scheduler and requests holding KV blocks.",
          (Query(f"sum by (model, instance) (kvgate_engine_requests_waiting{{{ENGINE_MODEL}}})",
                 "waiting {{model}} {{instance}}"),
           Query(f"sum by (model, instance) (kvgate_engine_requests_running{{{ENGINE_MODEL}}})",
                 "running {{model}} {{instance}}")), width=8),
    Panel("Engine prefix-cache hit rate", "percentunit",
          "Prompt tokens each engine found in its prefix cache over those it looked up: the engines' own view, "
          "beside the gateway's realised rate.",
          (Query(f"sum by (model, instance) (rate(kvgate_engine_prefix_hit_tokens_total{{{ENGINE_MODEL}}}{RATE}))\n"
                 f"/ sum by (model, instance) (rate(kvgate_engine_prefix_queried_tokens_total{{{ENGINE_MODEL}}}{RATE}))",
                 "{{model}} {{instance}}"),), width=8),
]

HEALTH = [
    Panel("Autoscaler copies holding the lease", "short",
          "kvgate_autoscaler_leader summed over copies: 1 is right; 0 for 2 minutes fires "
          "KvgateAutoscalerLeaseNotHeld.",
          (Query("sum(kvgate_autoscaler_leader)", "holding the lease"),), kind="stat", width=6),
    Panel("Seconds since the autoscaler's last tick", "s",
          "Now minus kvgate_autoscaler_last_tick_timestamp_seconds of the copy that ticked last.",
          (Query("time() - max(kvgate_autoscaler_last_tick_timestamp_seconds)", "since last tick"),),
          kind="stat", width=6),
    Panel("Processes reaching the state store", "percentunit",
          "Share of gateways and of autoscaler copies whose last call reached Redis "
          "(kvgate_*_state_store_up); under 100 % for 2 minutes fires KvgateStateStoreUnreachable.",
          (Query("avg(kvgate_router_state_store_up)", "gateways"),
           Query("avg(kvgate_autoscaler_state_store_up)", "autoscalers")), kind="stat", width=12),
]

ROWS = [("Traffic and errors", TRAFFIC), ("Latency", LATENCY), ("Prefix cache and tokens", CACHE_AND_TOKENS),
        ("Capacity and cost", CAPACITY), ("Engines", ENGINES), ("Control plane health", HEALTH)]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend,
                "range": True} for i, q in enumerate(panel.queries)]
    defaults: dict = {"unit": panel.unit, "min": 0}
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if panel.stacked else 0,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"}}
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto", "orientation": "auto"}
    return {"id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
            "datasource": DATASOURCE, "gridPos": {"x": x, "y": y, "w": panel.width, "h": HEIGHT},
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options, "targets": targets}


def panels() -> list[dict]:
    """Rows, each followed by its panels laid out left to right, wrapping at the grid's width."""
    found: list[dict] = []
    y = 0
    for title, row in ROWS:
        found.append({"id": len(found) + 1, "type": "row", "title": title, "collapsed": False,
                      "gridPos": {"x": 0, "y": y, "w": WIDTH, "h": 1}, "panels": []})
        y += 1
        x = 0
        for panel in row:
            if x + panel.width > WIDTH:
                x, y = 0, y + HEIGHT
            found.append(panel_json(panel, len(found) + 1, x, y))
            x += panel.width
        y += HEIGHT
    return found


def templating() -> dict:
    return {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "options": []},
        {"name": "model", "label": "Model", "type": "query", "datasource": DATASOURCE,
         "definition": "label_values(kvgate_router_in_flight, model)",
         "query": {"query": "label_values(kvgate_router_in_flight, model)", "refId": "model"},
         "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
         "refresh": 2, "sort": 1, "hide": 0, "options": []},
    ]}


def dashboard() -> dict:
    return {
        "uid": "kvgate", "title": "kvgate", "description": "kvgate gateway, autoscaler and engines "
        "(generated by helm/grafana_dashboard.py; edit that, not this file)",
        "tags": ["kvgate", "llm", "inference"], "editable": True, "graphTooltip": 1, "timezone": "browser",
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []}, "links": [], "templating": templating(), "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is not what this script writes")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the JSON file (default: {OUT})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if args.out.exists() and args.out.read_text() == text:
            print(f"{args.out} is current")
            return 0
        print(f"{args.out} is stale or missing: run `python helm/grafana_dashboard.py`", file=sys.stderr)
        return 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
