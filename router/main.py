"""`kvgate router` / `python -m kvgate.router`: the gateway alone, on uvloop.

    kvgate router --registry DIR [--host 127.0.0.1] [--port 8080] [--state redis://...|memory://] [--key-prefix P]
                  [--insecure-open-admin]

/admin/* and /metrics take their tokens from $KVGATE_ADMIN_TOKEN and $KVGATE_METRICS_TOKEN; without an admin token
the gateway starts only on a loopback --host, or with --insecure-open-admin (router/operator_access.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys

from aiohttp import web

from kvgate.clock import RealClock
from kvgate.state import REDIS_PASSWORD_ENV, open_state_store
from kvgate.registry.problems import RegistryInvalid
from kvgate.registry.watch import RegistryWatcher
from kvgate.router.app import build_app, gateway_runner
from kvgate.router.app_keys import DRAIN_KEY, Drain, GatewaySettings
from kvgate.router.tenants import KeySecretMissing, key_secret_for
from kvgate.router.operator_access import (AccessPlan, add_access_arguments, log_notices, plan_from_args,
                                           refused_to_start)

log = logging.getLogger("kvgate.router")

# Young-generation collections per allocated object: Python's default (700) runs one every few requests, and
# each walks every young object of the requests in flight; the gateway's garbage is almost all freed by
# reference counting, so collecting 70x less often costs a few MB at most. With `gc.freeze()` after start
# (the modules and registry never die, so full collections skip them), measured in
# loadtests/bench_gateway_overhead.py's setup: 1,846 -> 2,979 streamed requests/s, median of 3 A/B runs.
GC_GEN0_THRESHOLD = 50_000


def seconds(text: str) -> float:
    """`type=` for a duration that may be 0: one usage line for anything else."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate router", description="The cache-aware OpenAI gateway.")
    parser.add_argument("--registry", required=True, help="registry directory (hot-reloaded)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    parser.add_argument("--state", default=None,
                        help="state store for membership: redis://host:port/db or memory:// (default: none, "
                             "static replicas only); a Redis password may come from $KVGATE_REDIS_PASSWORD "
                             "instead of the URL, out of the process's arguments")
    parser.add_argument("--key-prefix", default="kvgate:",
                        help="with --state: the key prefix in Redis, the same as the autoscaler's --key-prefix "
                             "(default: %(default)s)")
    parser.add_argument("--member-grace-s", type=seconds, default=600.0,
                        help="with --state: a replica whose membership record lapses while it is READY (the "
                             "autoscaler restarting or failing over, Redis restarted empty) stays in rotation this "
                             "long, until it fails three health checks in a row or is listed again; 0 drops it at "
                             "once (default: 600)")
    parser.add_argument("--gateway-id", default="",
                        help="names this gateway's per-model observation records in the state store "
                             "(default: HOSTNAME-PID)")
    parser.add_argument("--drain-timeout-s", type=seconds, default=30.0,
                        help="on SIGTERM, how long in-flight requests may finish while /health says 503 and new "
                             "requests get 503; a second signal cuts it short (default: 30)")
    parser.add_argument("--max-body-bytes", type=int, default=GatewaySettings.max_body_bytes,
                        help="a request body over this gets 413 (default: %(default)s, 8 MiB)")
    parser.add_argument("--body-timeout-s", type=seconds, default=GatewaySettings.body_timeout_s,
                        help="a request body not all read this long after its headers gets 408; 0: no limit "
                             "(default: %(default)g)")
    parser.add_argument("--keepalive-timeout-s", type=seconds, default=GatewaySettings.keepalive_timeout_s,
                        help="an idle client connection (one that sent nothing or part of its headers, or "
                             "whose requests are all answered) is closed after this (default: %(default)g)")
    parser.add_argument("--usage-log", default=None, metavar="PATH",
                        help="append one JSON line per finished inference request (tenant, model, outcome, "
                             "tokens) to PATH, for billing; rotate by renaming the file (default: none)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        type=str.upper, help="(default: INFO)")
    add_access_arguments(parser)
    return parser


async def serve(args: argparse.Namespace, access: AccessPlan) -> int:
    from kvgate.router.replicas import ReplicaTracker, TrackerSettings  # grpc: only the server needs it

    clock = RealClock()
    try:
        watcher = await RegistryWatcher.open(args.registry, clock)
    except RegistryInvalid as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        key_secret = key_secret_for(watcher.current, os.environ)
    except KeySecretMissing as exc:
        print(f"kvgate router: {exc}", file=sys.stderr)
        return 2
    store = open_state_store(args.state, clock, prefix=args.key_prefix,
                                 password=os.environ.get(REDIS_PASSWORD_ENV)) if args.state else None
    tracker = ReplicaTracker(clock=clock, store=store, settings=TrackerSettings(member_grace_s=args.member_grace_s))
    settings = GatewaySettings(max_body_bytes=args.max_body_bytes, admin_token=access.admin_token,
                               metrics_token=access.metrics_token, gateway_id=args.gateway_id,
                               body_timeout_s=args.body_timeout_s, keepalive_timeout_s=args.keepalive_timeout_s,
                               key_secret=key_secret, usage_log_path=args.usage_log)
    app = build_app(settings, tracker, watcher, clock, store)
    runner = gateway_runner(app, shutdown_timeout_s=1.0)
    try:
        await runner.setup()
    except OSError as exc:  # the usage log cannot be opened
        print(f"kvgate router: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 2
    await web.TCPSite(runner, args.host, args.port).start()
    gc.collect()
    gc.freeze()  # everything built so far lives as long as the process: full collections need not walk it
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    log.info("kvgate router on http://%s:%d, registry %s (version %s)", args.host, args.port, args.registry,
             watcher.current.version)
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    watch = asyncio.create_task(watcher.watch(), name="kvgate-registry-watch")
    try:
        await stop.wait()
        await drain(app[DRAIN_KEY], args.drain_timeout_s, hurry)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await runner.cleanup()
        if store is not None:
            await store.close()
    log.info("kvgate router stopped")
    return 0


async def drain(state: Drain, timeout_s: float, hurry: asyncio.Event) -> None:
    """Refuse new requests and let the ones in flight finish, for at most `timeout_s` or until `hurry`."""
    state.draining = True
    log.info("draining: %d requests in flight, up to %.0f s (a second signal stops at once)", state.in_flight,
             timeout_s)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while state.in_flight and not hurry.is_set() and asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), 0.05)
    if state.in_flight:
        log.warning("drain over with %d requests in flight: cutting them", state.in_flight)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    access = plan_from_args(args, os.environ)
    if refused_to_start(access, parser.prog):  # before anything starts
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_notices(access, log)
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; fall back rather than refuse to start
        return asyncio.run(serve(args, access))
    return uvloop.run(serve(args, access))


if __name__ == "__main__":
    raise SystemExit(main())
