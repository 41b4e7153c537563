"""`kvgate up`: the whole stack on one box, in one process and one event loop.

    kvgate up [--registry examples/registry] [--host 127.0.0.1] [--port 8080] [--cache-dir DIR] [--insecure-open-admin]

The gateway's /admin/* and /metrics take their tokens from $KVGATE_ADMIN_TOKEN and $KVGATE_METRICS_TOKEN; without
an admin token `kvgate up` starts only on a loopback --host, or with --insecure-open-admin
(router/operator_access.py), and exits 2 otherwise before anything starts.

The composition root (DESIGN.md: it may import everything). In order:

1. **Registry**: load and validate it; every problem is printed with file:line and the command exits 1
   before anything starts. Adapters with a local `source` must exist (an engine would fail on them).
2. **Gateway**: the router app (`router.app.build_app`) with an in-memory state store, bound to
   --host/--port at once: a port in use is a one-line error and exit 1. From here on requests are
   accepted; a model with no replica yet holds them (up to its `max_queue_wait_s`).
3. **Models**: builtin model sources are prepared (built or downloaded into the cache) before any
   replica starts, with a line per model and its time.
4. **Autoscaler**: `autoscaler.loop.Autoscaler` embedded in this loop, one provider per pool (`local`
   pools get the cache directory), reading the hot-reloaded registry. It starts `kvgate engine`
   child processes (replicas), retries failed starts with back-off, and scales idle models to zero.
5. **Progress**: replica starting / ready / gone lines (the autoscaler logs its own decisions and
   failures with their reasons), then the OpenAI base URL and the dashboard URL once every model with
   `min_replicas` > 0 has its replicas ready or has failed once.
6. **Stop** (SIGINT or SIGTERM): the autoscaler stops, the gateway stops taking requests and lets
   in-flight ones finish, then every replica is drained and stopped and every node released
   (`Autoscaler.release_fleet`). Nothing is left running: this process owns the fleet.

The decisions here (what to print when) are pure functions; `serve` is the thin async shell.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.autoscaler.argtypes import positive_float
from kvgate.autoscaler.status import EventKind
from kvgate.clock import Clock, RealClock
from kvgate.state import AutoscalerStatus, MemberRecord, MemoryStateStore, ReplicaState, SkippedRecords
from kvgate.state.records import MALFORMED, read_status
from kvgate.registry.problems import Problem, RegistryInvalid
from kvgate.registry.snapshot import Snapshot

if TYPE_CHECKING:  # imported when serving only: aiohttp, grpc and the providers' SDKs load slowly
    from aiohttp import web

    from kvgate.autoscaler.loop import Autoscaler
    from kvgate.providers.base import Provider
    from kvgate.registry.watch import RegistryWatcher

log = logging.getLogger("kvgate.up")

DEFAULT_REGISTRY = "examples/registry"
CLUSTER = "kvgate-up"  # tagged on the local nodes and replicas this process owns
_PROGRESS_POLL_S = 0.5  # how often membership is read for the progress log (an in-memory read)


class StackError(Exception):
    """A user mistake or an environment problem that stops `kvgate up`; the message is one line."""


@dataclass(frozen=True, slots=True)
class UpSettings:
    """What `kvgate up` is asked to run. Times in seconds."""

    registry: Path = Path(DEFAULT_REGISTRY)
    host: str = "127.0.0.1"
    port: int = 8080
    cache_dir: Path | None = None  # builtin model files; None: $KVGATE_CACHE_DIR, else ~/.cache/kvgate
    interval_s: float = 1.0  # autoscaler tick
    drain_timeout_s: float = 10.0  # on stop: how long in-flight requests may take to finish
    # Out of repr, so a settings object in a log line shows no token (router/operator_access.py).
    admin_token: str | None = field(default=None, repr=False)  # protects /admin/*, the dashboard and /metrics
    metrics_token: str | None = field(default=None, repr=False)  # opens /metrics (for Prometheus) when set
    usage_log: Path | None = None  # the gateway's usage log (router/usage_log.py); None: none


# ------------------------------------------------------------------------------------ pure decisions


def missing_adapter_sources(snapshot: Snapshot, cwd: Path) -> list[Problem]:
    """Adapters whose local `source` directory does not exist (an engine given one fails at start).
    Relative sources are relative to `cwd`, where the engines run. s3:// sources are not checked, nor
    builtin: ones (the engine writes those into its cache)."""
    problems = []
    for name, adapter in sorted(snapshot.adapters.items()):
        source = adapter.spec.source
        if "://" in source or source.startswith("builtin:"):
            continue
        path = Path(source).expanduser()
        if not (path if path.is_absolute() else cwd / path).is_dir():
            file, line = snapshot.origins.get(("Adapter", name), (snapshot.source, 0))
            problems.append(Problem(file, line, f"Adapter/{name}", ("spec", "source"),
                                    f"{source!r} is not a directory (relative to {cwd}); write the adapter "
                                    "there or point source at a PEFT directory"))
    return problems


def display_host(host: str) -> str:
    """The host to put in URLs a person will paste: a wildcard bind is reached on loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else (f"[{host}]" if ":" in host else host)


def urls_banner(host: str, port: int) -> str:
    base = f"http://{display_host(host)}:{port}"
    return (f"kvgate is up.\n"
            f"  OpenAI base URL  {base}/v1\n"
            f"  dashboard        {base}/dashboard\n"
            f"  Ctrl-C stops everything (replicas are drained and stopped).")


@dataclass(frozen=True, slots=True)
class Progress:
    """What the progress log knows between polls: the replicas seen (id -> state), when each was first
    seen (monotonic s), and whether the URL banner has been printed."""

    states: Mapping[str, ReplicaState] = field(default_factory=dict)
    first_seen: Mapping[str, float] = field(default_factory=dict)
    banner_shown: bool = False


def progress_step(progress: Progress, members: Iterable[MemberRecord], now: float,
                  wanted: Mapping[str, int], failed_models: Iterable[str]) -> tuple[Progress, list[str], bool]:
    """Compare membership with the last poll: returns the new progress, the lines to log, and whether
    the URL banner is due now (once: every model in `wanted` (model -> min_replicas > 0) has that many
    ready replicas or is in `failed_models`)."""
    current = {m.replica_id: m for m in members}
    lines = []
    first_seen = dict(progress.first_seen)
    for replica_id, member in sorted(current.items()):
        before = progress.states.get(replica_id)
        if before == member.state:
            continue
        first_seen.setdefault(replica_id, now)
        if member.state is ReplicaState.STARTING:
            lines.append(f"{member.model}: replica {replica_id} starting (loading the model) at {member.url}")
        elif member.state is ReplicaState.READY:
            lines.append(f"{member.model}: replica {replica_id} ready at {member.url} "
                         f"({now - first_seen[replica_id]:.1f} s after it was seen starting)")
        elif member.state is ReplicaState.DRAINING:
            lines.append(f"{member.model}: replica {replica_id} draining")
    for replica_id in sorted(set(progress.states) - set(current)):
        lines.append(f"replica {replica_id} is gone")
        first_seen.pop(replica_id, None)
    due = False
    if not progress.banner_shown:
        ready: dict[str, int] = {}
        for member in current.values():
            if member.state is ReplicaState.READY:
                ready[member.model] = ready.get(member.model, 0) + 1
        failed = set(failed_models)
        due = all(ready.get(model, 0) >= count or model in failed for model, count in wanted.items())
    new = Progress(states={rid: m.state for rid, m in current.items()}, first_seen=first_seen,
                   banner_shown=progress.banner_shown or due)
    return new, lines, due


def failed_models_of(status: AutoscalerStatus | None) -> set[str]:
    """Models with a replica_failed event in the autoscaler's status record."""
    events = status.events if status is not None else ()
    return {e.model for e in events if e.kind == EventKind.REPLICA_FAILED and e.model}


# --------------------------------------------------------------------------------------- the shell


async def serve(settings: UpSettings, clock: Clock | None = None) -> int:
    """Run the stack until SIGINT/SIGTERM; returns the exit status (0 after a clean stop, 1 when the
    registry is invalid, the port is taken or a model cannot be prepared: nothing is left running)."""
    clock = clock or RealClock()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    watcher = await _open_registry(settings.registry, clock)
    if watcher is None:
        return 1
    snapshot = watcher.current
    store = MemoryStateStore(clock)
    runner = await _open_gateway(settings, watcher, store, clock)
    if runner is None:
        await store.close()
        return 1

    running = RunningStack(store, runner, asyncio.create_task(watcher.watch(), name="kvgate-registry-watch"))
    try:
        if not await _prepare_models(snapshot, settings.cache_dir, stop, clock):
            return 0 if stop.is_set() else 1
        running.autoscaler = _build_autoscaler(watcher, store, clock, settings)
        _wake_on_demand(runner, running.autoscaler)
        _export_autoscaler_metrics(runner, running.autoscaler, clock)
        await running.autoscaler.start()
        running.progress = asyncio.create_task(_report_progress(store, snapshot, settings, clock),
                                               name="kvgate-up-progress")
        await stop.wait()
        log.info("stopping: no new replicas; the gateway finishes in-flight requests (up to %.0f s)",
                 settings.drain_timeout_s)
        return 0
    finally:
        # Signals during the stop must not kill it half-way: the fleet is released whatever happens.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: log.info("already stopping; replicas are being drained"))
        await shut_down(running, clock)


def _wake_on_demand(runner: web.AppRunner, autoscaler: Autoscaler) -> None:
    """From zero replicas, nothing waits out a timer in this one process: the first request waiting at a model
    makes the gateway publish its observation at once (router.observations), which makes the autoscaler tick
    (it starts a replica); that replica's readiness wakes it again (it publishes the replica READY), which makes
    the gateway read membership (the store's member listener, above). Each step otherwise waits for a tick or a
    poll, which added 1-4 s to a request's first token from zero (loadtests/bench_scale_from_zero.py)."""
    from kvgate.router.app_keys import PUBLISHER_KEY

    runner.app[PUBLISHER_KEY].on_urgent_publish(autoscaler.wake)


async def _open_registry(path: Path, clock: Clock) -> RegistryWatcher | None:
    """The hot-reloading registry; None after printing every problem in it (nothing has started)."""
    from kvgate.registry.watch import RegistryWatcher

    try:
        watcher = await RegistryWatcher.open(path, clock)
        problems = missing_adapter_sources(watcher.current, Path.cwd())
        if problems:
            raise RegistryInvalid(str(path), problems)
    except RegistryInvalid as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return None
    snapshot = watcher.current
    log.info("registry %s (version %s): %d model(s), %d adapter(s), %d pool(s); hot reload on",
             path, snapshot.version, len(snapshot.models), len(snapshot.adapters), len(snapshot.pools))
    return watcher


async def _open_gateway(settings: UpSettings, watcher: RegistryWatcher, store: MemoryStateStore,
                        clock: Clock) -> web.AppRunner | None:
    """The gateway, listening on --host/--port; None after printing why it cannot listen, or cannot check the
    registry's API keys (cleaned up)."""
    from kvgate.router.app import GatewaySettings, build_app, gateway_runner
    from kvgate.router.replicas import ReplicaTracker, TrackerSettings  # grpc: imported only when serving
    from kvgate.router.tenants import KeySecretMissing, key_secret_for

    try:
        key_secret = key_secret_for(watcher.current, os.environ)
    except KeySecretMissing as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return None
    tracker = ReplicaTracker(clock=clock, store=store, settings=TrackerSettings(poll_interval_s=_PROGRESS_POLL_S))
    store.on_member_change(tracker.poll_members_soon)  # a replica published READY is routable at once
    gateway = GatewaySettings(admin_token=settings.admin_token, metrics_token=settings.metrics_token,
                              gateway_id="kvgate-up", key_secret=key_secret,
                              usage_log_path=str(settings.usage_log) if settings.usage_log else None)
    runner = gateway_runner(build_app(gateway, tracker, watcher, clock, store),
                            shutdown_timeout_s=settings.drain_timeout_s)
    try:
        await runner.setup()  # OSError: the usage log cannot be opened
        await _listen(runner, settings.host, settings.port)
    except (StackError, OSError) as exc:
        await runner.cleanup()
        print(f"kvgate up: {exc}", file=sys.stderr)
        return None
    log.info("gateway listening on http://%s:%d (requests wait there while replicas start)",
             display_host(settings.host), settings.port)
    return runner


@dataclass
class RunningStack:
    """What `serve` has started, for `shut_down` to stop in order; the last two once models are ready."""

    store: MemoryStateStore
    runner: web.AppRunner
    watch: asyncio.Task[None]
    autoscaler: Autoscaler | None = None
    progress: asyncio.Task[None] | None = None


async def shut_down(running: RunningStack, clock: Clock) -> None:
    """Stop what runs, in order: the progress log and the autoscaler (no new replicas), the gateway (it lets
    in-flight requests finish, up to the drain timeout), then the fleet (`_release`, which logs how long the
    whole stop took, counted from here), the registry watch and the store."""
    started = clock.now()
    if running.progress is not None:
        running.progress.cancel()
        await asyncio.gather(running.progress, return_exceptions=True)
    if running.autoscaler is not None:
        await running.autoscaler.stop()
    await running.runner.cleanup()
    if running.autoscaler is not None:
        await _release(running.autoscaler, clock, started)
    running.watch.cancel()
    await asyncio.gather(running.watch, return_exceptions=True)
    await running.store.close()


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    from aiohttp import web

    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StackError(f"port {port} on {host} is already in use; stop what uses it or pick "
                             "another with --port") from None
        raise StackError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def _prepare_models(snapshot: Snapshot, cache_dir: Path | None, stop: asyncio.Event, clock: Clock) -> bool:
    """Build or download every builtin model into the cache before replicas start (they would each do
    it, and a first download takes a minute). False when one fails (logged) or a stop came first."""
    from kvgate.engine.builtin import BUILTIN_PREFIX, ModelSourceError, default_cache_dir, resolve_model_source

    cache = cache_dir or default_cache_dir()
    models_of: dict[str, list[str]] = {}  # several models may share one source: prepared once
    for name, model in sorted(snapshot.models.items()):
        if model.spec.source.startswith(BUILTIN_PREFIX):
            models_of.setdefault(model.spec.source, []).append(name)
    for source, names in sorted(models_of.items()):
        name = ", ".join(names)
        started = clock.now()
        log.info("%s: preparing %s in %s (the first run builds or downloads it)", name, source, cache)
        # A thread, not the loop: the gateway keeps serving /health and the dashboard meanwhile.
        task = asyncio.ensure_future(asyncio.to_thread(resolve_model_source, source, cache))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not task.done():
            log.info("stopping while %s is being prepared; it finishes in the background first", name)
            await asyncio.gather(task, return_exceptions=True)
            return False
        try:
            path = task.result()
        except ModelSourceError as exc:
            log.error("%s: cannot prepare %s: %s", name, source, exc)
            return False
        log.info("%s: model ready at %s (%.1f s)", name, path, clock.now() - started)
    return True


def _export_autoscaler_metrics(runner: web.AppRunner, autoscaler: Autoscaler, clock: Clock) -> None:
    """The embedded autoscaler's `kvgate_autoscaler_*` series on the gateway's /metrics: one scrape, one box."""
    from kvgate.autoscaler.metrics import AutoscalerCollector
    from kvgate.router.app_keys import METRICS_KEY

    runner.app[METRICS_KEY].registry.register(AutoscalerCollector(autoscaler.reading, clock.wall))


def _build_autoscaler(watcher: RegistryWatcher, store: MemoryStateStore, clock: Clock,
                      settings: UpSettings) -> Autoscaler:
    from kvgate.autoscaler.loop import Autoscaler, AutoscalerSettings
    from kvgate.providers.build import build_provider
    from kvgate.registry.schema import PoolDoc, Provider as ProviderKind

    def provider_for(pool_name: str, pool: PoolDoc) -> Provider:
        # Only local pools run engines here and need the model cache; cloud pools take no options.
        options = {"cache_dir": settings.cache_dir} if pool.spec.provider is ProviderKind.LOCAL else {}
        return build_provider(pool_name, pool.spec, cluster=CLUSTER, clock=clock, **options)

    autoscaler_settings = AutoscalerSettings(
        interval_s=settings.interval_s, lease_ttl_s=max(10.0, 3 * settings.interval_s),
        member_ttl_s=max(10.0, 3 * settings.interval_s), drain_timeout_s=settings.drain_timeout_s)
    return Autoscaler(watcher, store, clock, provider_factory=provider_for, settings=autoscaler_settings,
                      holder=f"kvgate-up-{os.getpid()}")


async def _report_progress(store: MemoryStateStore, snapshot: Snapshot, settings: UpSettings, clock: Clock) -> None:
    wanted = {name: doc.spec.scaling.min_replicas for name, doc in snapshot.models.items()
              if doc.spec.scaling.min_replicas > 0 and not doc.spec.routing.static_replicas}
    progress = Progress()
    skipped = SkippedRecords(log)
    while True:
        try:
            status = await read_status(store, skipped)
        except MALFORMED:  # written by this process's own autoscaler, so never expected: no model has failed
            status = None
        failed = failed_models_of(status)
        progress, lines, due = progress_step(progress, await store.list_members(), clock.now(), wanted, failed)
        for line in lines:
            log.info("%s", line)
        if due:
            print(urls_banner(settings.host, settings.port), flush=True)
        await clock.sleep(_PROGRESS_POLL_S)


async def _release(autoscaler: Autoscaler, clock: Clock, started: float) -> None:
    """Drain and stop every replica and release every node; then make sure no replica is listed. The log's
    "stopped in" counts from `started` (clock time), when the whole stop began: the gateway's drain before
    this call is part of it."""
    from kvgate.providers.base import ProviderError

    try:
        await autoscaler.release_fleet()  # its events are logged by the autoscaler as they happen
    except Exception as exc:  # the memory store does not fail; anything else must not skip the sweep below
        log.error("releasing the fleet failed: %s; stopping what is listed", exc)
    left = 0
    for pool, provider in sorted(autoscaler.providers.items()):
        try:
            for replica in await provider.list_replicas():  # e.g. on no node the fleet knew of
                await provider.stop_replica(replica.id, 0.0)
                left += 1
            await provider.close()
        except ProviderError as exc:
            log.error("pool %s: %s", pool, exc)
    log.info("stopped in %.1f s: every replica and node released%s", clock.now() - started,
             f" ({left} stray replica(s) killed)" if left else "")


# ------------------------------------------------------------------------------------------ the CLI


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate up", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the whole stack on this machine: the gateway (OpenAI API and /dashboard), the "
                    "autoscaler with the local provider, and engine replicas as child processes.",
        epilog="Ctrl-C or SIGTERM drains in-flight requests, stops every replica and exits; nothing is left "
               "running.\nExample: kvgate up --registry examples/registry --port 8080")
    parser.add_argument("--registry", type=Path, default=Path(DEFAULT_REGISTRY), metavar="DIR",
                        help="registry directory, hot-reloaded (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8080, help="gateway port (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                        help="where builtin models are built and kept (default: $KVGATE_CACHE_DIR, "
                             "else ~/.cache/kvgate)")
    parser.add_argument("--interval-s", type=positive_float, default=1.0,
                        help="seconds between autoscaler ticks (default: %(default)s)")
    parser.add_argument("--drain-timeout-s", type=positive_float, default=10.0,
                        help="on stop, how long in-flight requests may finish (default: %(default)s)")
    parser.add_argument("--usage-log", type=Path, default=None, metavar="PATH",
                        help="append one JSON line per finished inference request (tenant, model, outcome, tokens) "
                             "to PATH, for billing; rotate by renaming the file (default: none)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    from kvgate.router.operator_access import add_access_arguments  # aiohttp: imported when used

    add_access_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvgate.router.operator_access import log_notices, plan_from_args, refused_to_start

    parser = build_parser()
    args = parser.parse_args(argv)
    access = plan_from_args(args, os.environ)
    if refused_to_start(access, parser.prog):  # before anything starts
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    log_notices(access, log)
    if args.log_level != "DEBUG":
        # The gateway retries a starting engine's state stream (each refusal a warning) until the model has
        # loaded: noise here, where the progress lines and the autoscaler's events say how replicas are.
        logging.getLogger("kvgate.router.load_readers").setLevel(logging.ERROR)
    settings = UpSettings(registry=args.registry, host=args.host, port=args.port, cache_dir=args.cache_dir,
                          interval_s=args.interval_s, drain_timeout_s=args.drain_timeout_s,
                          admin_token=access.admin_token, metrics_token=access.metrics_token,
                          usage_log=args.usage_log)
    try:
        import uvloop
    except ImportError:  # a dependency; fall back rather than refuse to start
        return asyncio.run(serve(settings))
    return uvloop.run(serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
