"""An in-process kvgate gateway on a free loopback port, for tests that drive it over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from kvgate.clock import RealClock
from kvgate.state.base import StateStore
from kvgate.registry.watch import RegistryWatcher
from kvgate.router.app import GatewaySettings, build_app, gateway_runner
from kvgate.router.replicas import ReplicaTracker


@contextlib.asynccontextmanager
async def running_gateway(registry_dir: Path, settings: GatewaySettings | None = None,
                          store: StateStore | None = None, **tracker_knobs: object
                          ) -> AsyncIterator[tuple[str, ReplicaTracker]]:
    """(base URL, tracker) of a gateway over `registry_dir`. Health checks and membership polls default to
    every 60 s, so that nothing but requests and the replicas' state streams moves during a test."""
    clock = RealClock()
    watcher = await RegistryWatcher.open(registry_dir, clock)
    tracker = ReplicaTracker(clock=clock, **{"poll_interval_s": 60.0, "health_interval_s": 60.0, **tracker_knobs})
    runner = gateway_runner(build_app(settings or GatewaySettings(), tracker, watcher, clock, store),
                            shutdown_timeout_s=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", tracker
    finally:
        await runner.cleanup()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Until `predicate()` holds, polled every 10 ms; fails the test after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
