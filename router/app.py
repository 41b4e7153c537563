"""The gateway's composition: `build_app(settings, tracker, registry, clock)` -> an aiohttp app.

The app owns its pool of upstream connections (`router.upstream`), its metrics registry and its wait
queues; it starts the replica tracker on startup and closes it on cleanup (`cleanup_ctx`), and follows
registry reloads when the registry source can be subscribed to (a `registry.watch.RegistryWatcher`). Serve
it with `gateway_runner(app, ...)`, so that a client that goes away cancels its upstream request and idle
connections close (`router.main` and `kvgate up` do).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from kvgate.clock import Clock
from kvgate.server_log import MalformedRequestLog
from kvgate.state.base import StateStore
from kvgate.registry.snapshot import Snapshot
from kvgate.router.dashboard import Dashboard, gauge_values
from kvgate.router.flow_control import FlowGate, FlowGates
from kvgate.router.handlers import error_middleware, install_routes
from kvgate.router.app_keys import (CLOCK_KEY, DASHBOARD_KEY, DRAIN_KEY, FINISHED_KEY, GATES_KEY, METRICS_KEY, OPENINGS_KEY, PROMPT_WORK_KEY, PROXY_KEY,
                         PUBLISHER_KEY, QUEUES_KEY,
                         LIMITER_KEY, METER_KEY, REGISTRY_KEY, SEQUENCE_KEY, SETTINGS_KEY, TENANTS_KEY, TRACKER_KEY,
                         Drain, GatewaySettings)
from kvgate.router.metrics import RouterMetrics
from kvgate.router.observations import ObservationPublisher, PromptWork
from kvgate.router.operator_access import operator_auth
from kvgate.router.common_openings import CommonOpenings
from kvgate.router.proxy import Proxy
from kvgate.router.replicas import ReplicaTracker
from kvgate.router.queueing import WaitQueues
from kvgate.router.admission import TenantLimiter
from kvgate.router.tenants import TenantAccess
from kvgate.router.upstream import UpstreamPool
from kvgate.router.usage import UsageMeter
from kvgate.router.usage_log import UsageLog

__all__ = ["GatewaySettings", "SnapshotSource", "build_app"]

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Where the gateway reads the registry in force (`RegistryWatcher` is one)."""

    @property
    def current(self) -> Snapshot: ...


@dataclass(frozen=True)
class StaticSnapshot:
    """A SnapshotSource that never changes: for tests and embedded use without a watcher."""

    current: Snapshot


def gateway_runner(app: web.Application, shutdown_timeout_s: float) -> web.AppRunner:
    """How every gateway is served: a client that goes away cancels its handler (and so its upstream
    request), no access log (the metrics count every answer), and idle client connections closed after the
    settings' `keepalive_timeout_s`. A request that does not parse is one WARNING line per kind per minute, never
    a traceback quoting its headers (`kvgate.server_log`)."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s,
                         keepalive_timeout=app[SETTINGS_KEY].keepalive_timeout_s,
                         logger=MalformedRequestLog(logging.getLogger("aiohttp.server"), app[CLOCK_KEY].now))


def build_app(settings: GatewaySettings, tracker: ReplicaTracker, registry: SnapshotSource, clock: Clock,
              store: StateStore | None = None) -> web.Application:
    """The gateway app. Nothing starts until the app does (tracker, client session, registry follow,
    the dashboard's sampler). `store`, when given, is where the dashboard reads the autoscaler's
    status record and replica placement (the tracker reads membership from its own), and where the
    gateway publishes its per-model observations for the autoscaler (`router.observations`)."""
    # error_middleware outermost: it renders and counts every refusal, operator_auth's 401s included.
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[
        error_middleware, operator_auth(settings.admin_token, settings.metrics_token)])
    metrics = RouterMetrics()
    app[SETTINGS_KEY] = settings
    app[TRACKER_KEY] = tracker
    app[REGISTRY_KEY] = registry
    app[CLOCK_KEY] = clock
    app[METRICS_KEY] = metrics
    app[PROMPT_WORK_KEY] = PromptWork()
    app[QUEUES_KEY] = WaitQueues(tracker.wait_for_replica,
                                 lambda model, depth: metrics.queue_depth.labels(model).set(depth))
    app[GATES_KEY] = FlowGates(clock, tracker.capacity, on_change=_fair_queue_gauges(metrics), probes=tracker.probes)
    tracker.on_change(app[GATES_KEY].dispatch_all)
    app[SEQUENCE_KEY] = collections.Counter()
    app[FINISHED_KEY] = collections.Counter()
    app[OPENINGS_KEY] = CommonOpenings()
    app[DRAIN_KEY] = Drain()
    app[TENANTS_KEY] = TenantAccess(settings.key_secret)
    app[LIMITER_KEY] = TenantLimiter(store, clock)
    app[METER_KEY] = UsageMeter(metrics, clock)
    app[DASHBOARD_KEY] = Dashboard(metrics=metrics, queues=app[QUEUES_KEY], clock=clock, ready_count=tracker.num_ready,
                                   model_names=lambda: registry.current.models, store=store,
                                   sample_interval_s=settings.dashboard_sample_interval_s,
                                   history_s=settings.dashboard_history_s)
    app.cleanup_ctx.append(_resources)
    if settings.usage_log_path is not None:
        app.cleanup_ctx.append(_usage_log)
    app.cleanup_ctx.append(_background("kvgate-dashboard-sampler", lambda app: app[DASHBOARD_KEY].run_sampler()))
    app.cleanup_ctx.append(_background("kvgate-retire-replicas", _retire_gone_replicas))
    if store is not None:
        dashboard = app[DASHBOARD_KEY]
        publisher = ObservationPublisher(
            store=store, gateway_id=settings.gateway_id or f"{socket.gethostname()}-{os.getpid()}", clock=clock,
            model_names=lambda: registry.current.models, arrivals=app[SEQUENCE_KEY], finished=app[FINISHED_KEY],
            queued=lambda model: app[QUEUES_KEY].depth(model) + app[GATES_KEY].depth(model),
            in_flight=lambda: gauge_values(metrics.in_flight),
            ttft_p99_s=lambda: _ttft_p99_s(dashboard), prompt_work=app[PROMPT_WORK_KEY],
            interval_s=settings.observation_interval_s)
        app[PUBLISHER_KEY] = publisher
        app[QUEUES_KEY].on_first_waiter(lambda model: publisher.publish_soon())
        app.cleanup_ctx.append(lambda app: _publishing(publisher))
    install_routes(app)
    return app


def _fair_queue_gauges(metrics: RouterMetrics) -> Callable[[FlowGate], None]:
    """Keeps `kvgate_router_fair_queue_depth` to each gate's queue per tenant (a tenant no longer waiting: 0)."""
    shown: dict[str, set[str]] = collections.defaultdict(set)

    def note(gate: FlowGate) -> None:
        depths = gate.depth_by_tenant()
        for tenant in shown[gate.model] - depths.keys():
            metrics.fair_queue_depth.labels(gate.model, tenant).set(0)
        for tenant, depth in depths.items():
            metrics.fair_queue_depth.labels(gate.model, tenant).set(depth)
        shown[gate.model] |= depths.keys()
    return note


async def _resources(app: web.Application) -> AsyncIterator[None]:
    tracker, registry = app[TRACKER_KEY], app[REGISTRY_KEY]
    upstream = UpstreamPool()
    app[PROXY_KEY] = Proxy(tracker, upstream, app[METRICS_KEY], app[CLOCK_KEY], app[QUEUES_KEY], app[PROMPT_WORK_KEY])
    await tracker.start(registry.current)
    tenants, metrics = app[TENANTS_KEY], app[METRICS_KEY]
    tenants.note_registry(registry.current)
    metrics.note_registry(registry.current)
    subscribe: Callable[..., Callable[[], None]] | None = getattr(registry, "subscribe", None)
    unsubscribe = ([subscribe(tracker.update_registry), subscribe(tenants.note_registry),
                    subscribe(metrics.note_registry)] if subscribe else [])
    try:
        yield
    finally:
        for stop in unsubscribe:
            stop()
        await tracker.close()
        await upstream.close()


async def _usage_log(app: web.Application) -> AsyncIterator[None]:
    """The usage log, open while the app runs; at cleanup, after the requests in flight ended (the cleanup_ctx
    entries after this one close first), what it still holds is written out. Raises OSError at start when the
    file cannot be opened."""
    meter, metrics = app[METER_KEY], app[METRICS_KEY]
    meter.usage_log = UsageLog(app[SETTINGS_KEY].usage_log_path, app[CLOCK_KEY].now,
                               on_dropped=metrics.usage_records_dropped.inc)
    try:
        yield
    finally:
        await meter.close()
        meter.usage_log = None


def _background(name: str, run: Callable[[web.Application], Awaitable[None]]
                ) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup_ctx entry that runs `run(app)` as a task while the app runs, and cancels it at cleanup."""
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(run(app), name=name)
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return ctx


async def _retire_gone_replicas(app: web.Application) -> None:
    """Drop the per-replica series of replicas gone `retire_replica_series_after_s` ago; checked at a
    quarter of that interval (at most every minute), so a series outlives its replica by up to 1.25x it
    (or a minute past it)."""
    settings, clock, tracker = app[SETTINGS_KEY], app[CLOCK_KEY], app[TRACKER_KEY]
    after_s = settings.retire_replica_series_after_s
    while True:
        await clock.sleep(min(max(after_s / 4, 0.05), 60.0))  # never a busy loop, whatever the setting
        removed = app[METRICS_KEY].retire_replicas(tracker.replica_ids(), clock.now(), after_s)
        app[PROXY_KEY].forget_replicas(removed)


def _ttft_p99_s(dashboard: Dashboard) -> dict[str, float | None]:
    return {model: stats.ttft_p99_s for model, stats in dashboard.history.latest(dashboard.window_s).items()}


async def _publishing(publisher: ObservationPublisher) -> AsyncIterator[None]:
    task = asyncio.create_task(publisher.run(), name="kvgate-observations")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.withdraw()
