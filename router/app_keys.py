"""Typed app keys and the gateway's settings (a leaf module, so handlers and app share them)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from aiohttp import web

from kvgate.clock import Clock
from kvgate.router.dashboard import Dashboard
from kvgate.router.flow_control import FlowGates
from kvgate.router.metrics import RouterMetrics
from kvgate.router.observations import ObservationPublisher, PromptWork
from kvgate.router.common_openings import CommonOpenings
from kvgate.router.proxy import Proxy
from kvgate.router.replicas import ReplicaTracker
from kvgate.router.queueing import WaitQueues
from kvgate.router.admission import Admitted, TenantLimiter
from kvgate.router.tenants import TenantAccess
from kvgate.router.usage import UsageMeter


@dataclass(frozen=True)
class GatewaySettings:
    """Gateway-wide settings (per-model knobs live in the registry)."""

    max_body_bytes: int = 8 * 1024 * 1024  # a request body over this gets 413
    body_timeout_s: float = 60.0  # a request body not all read this long after its headers gets 408
    keepalive_timeout_s: float = 75.0  # an idle client connection is closed after this (aiohttp's default: 3,630)
    # When set, /admin/* needs `Authorization: Bearer <admin_token>`, and /metrics that or the metrics token
    # (`router.operator_access`). Out of repr: a settings object in a log line or traceback shows no token.
    admin_token: str | None = field(default=None, repr=False)
    metrics_token: str | None = field(default=None, repr=False)  # when set, /metrics needs it (or the admin token)
    # The server secret API keys are hashed with (`registry.tenant`, $KVGATE_KEY_SECRET); None: no key can be
    # checked, so a registry declaring tenants gets every request refused (router.main refuses to start so).
    key_secret: bytes | None = field(default=None, repr=False)
    default_queue_wait_s: float = 30.0  # wait at zero replicas when the model sets no max_queue_wait_s
    dashboard_sample_interval_s: float = 2.0  # one history sample per this many seconds ...
    dashboard_history_s: float = 3600.0  # ... kept for this long (the dashboard's "last 1 h"; router.stats_history)
    gateway_id: str = ""  # names this gateway's observation records; "" -> hostname-pid
    observation_interval_s: float = 1.0  # how often observations go to the state store (with one)
    # The per-replica series of a replica that left (`kvgate_router_requests`, /admin/stats outcomes) are
    # dropped this long after, so that replicas coming and going do not grow /metrics without end.
    retire_replica_series_after_s: float = 600.0
    # Where each finished inference request is appended as one JSON line for billing (`router.usage_log`);
    # None: no usage log (the per-tenant counts are still in /metrics and /admin/stats).
    usage_log_path: str | None = None


@dataclass
class Drain:
    """A gateway's shutdown: once `draining` (SIGTERM, `router.main`), /health answers 503 so load balancers
    stop sending, new inference requests get 503 with Retry-After, and the ones `in_flight` finish."""

    draining: bool = False
    in_flight: int = 0  # inference requests between arrival and their response's end


SETTINGS_KEY = web.AppKey("kvgate_settings", GatewaySettings)
TRACKER_KEY = web.AppKey("kvgate_tracker", ReplicaTracker)
REGISTRY_KEY: web.AppKey[object] = web.AppKey("kvgate_registry", object)
CLOCK_KEY = web.AppKey("kvgate_clock", Clock)
METRICS_KEY = web.AppKey("kvgate_metrics", RouterMetrics)
QUEUES_KEY = web.AppKey("kvgate_queues", WaitQueues)
GATES_KEY = web.AppKey("kvgate_flow_gates", FlowGates)  # per model: fair queuing while saturated
PROXY_KEY = web.AppKey("kvgate_proxy", Proxy)
PROMPT_WORK_KEY = web.AppKey("kvgate_prompt_work", PromptWork)  # what the proxy routed, for observations
# The gateway's observation publisher, where it has a state store (`router.observations`).
PUBLISHER_KEY = web.AppKey("kvgate_observation_publisher", ObservationPublisher)
SEQUENCE_KEY = web.AppKey("kvgate_request_seq", collections.Counter)  # per model: round robin's counter
FINISHED_KEY = web.AppKey("kvgate_requests_finished", collections.Counter)  # per model: requests a replica served
DASHBOARD_KEY = web.AppKey("kvgate_dashboard", Dashboard)
DRAIN_KEY = web.AppKey("kvgate_drain", Drain)
REQUEST_ID_KEY = web.RequestKey("kvgate_request_id", str)  # an inference request's REQUEST_ID_HEADER
OPENINGS_KEY = web.AppKey("kvgate_common_openings", CommonOpenings)  # per model: what nearly every request opens with
TENANTS_KEY = web.AppKey("kvgate_tenants", TenantAccess)  # API keys -> tenants (`router.tenants`)
LIMITER_KEY = web.AppKey("kvgate_tenant_limits", TenantLimiter)  # tenants' rate limits (`router.admission`)
METER_KEY = web.AppKey("kvgate_usage_meter", UsageMeter)  # per-tenant usage (`router.usage`)
ADMITTED_KEY = web.RequestKey("kvgate_admitted", Admitted)  # an inference request's admission: its x-ratelimit-*
# An inference request's answer from the proxy, set once it is whole, before the tenant's limits are settled: a client
# that leaves during the settling still had its answer (kvgate_router_answers_total).
ANSWERED_KEY = web.RequestKey("kvgate_answered", web.StreamResponse)
