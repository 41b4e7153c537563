"""An in-process kvgate gateway on a free loopback port, for tests that drive it over real HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.clock import Clock, RealClock
from kvgate.state.base import StateStore
from kvgate.registry.watch import RegistryWatcher
from kvgate.router.app import GatewaySettings, build_app, gateway_runner
from kvgate.router.replicas import ReplicaTracker, TrackerSettings


@contextlib.asynccontextmanager
async def running_gateway(registry_dir: Path, settings: GatewaySettings | None = None,
                          store: StateStore | None = None, *, clock: Clock | None = None,
                          http: aiohttp.ClientSession | None = None, **tracker_knobs: object
                          ) -> AsyncIterator[tuple[str, ReplicaTracker]]:
    """(base URL, tracker) of a gateway over `registry_dir`. Health checks and membership polls default to
    every 60 s, so that nothing but requests and the replicas' state streams moves during a test.
    `clock` (default a real one) drives the gateway's timers: a `FakeClock` holds a request waiting at
    zero replicas, and the observation and retirement loops, until the test advances it. `http` is the
    tracker's client session for probes and scrapes (the caller closes it)."""
    clock = clock if clock is not None else RealClock()
    watcher = await RegistryWatcher.open(registry_dir, clock)
    tracker = ReplicaTracker(clock=clock, http=http, settings=TrackerSettings(
        **{"poll_interval_s": 60.0, "health_interval_s": 60.0, **tracker_knobs}))
    runner = gateway_runner(build_app(settings or GatewaySettings(), tracker, watcher, clock, store),
                            shutdown_timeout_s=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", tracker
    finally:
        await runner.cleanup()
