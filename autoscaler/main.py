"""`kvgate autoscaler` / `python -m kvgate.autoscaler`: the control loops, one active copy per cluster.

    kvgate autoscaler --registry DIR --state redis://host:6379/0 [--cluster NAME] [--interval-s 1]
                      [--engine-pod-template FILE] [--metrics-port PORT [--metrics-host HOST]]

Run as many copies as you like for availability: they share a lease in the state store, one acts and
the others wait, taking over within --lease-ttl-s of the active one dying (at once when it stops
cleanly). SIGTERM or Ctrl-C stops the loop and releases the lease; nodes and replicas are left
running on purpose, and the next autoscaler adopts them through their claim records.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import yaml
from aiohttp import web

from kvgate.autoscaler.argtypes import positive_float
from kvgate.autoscaler.loop import Autoscaler, AutoscalerSettings, default_holder, provider_factory_for
from kvgate.autoscaler.metrics import autoscaler_registry
from kvgate.autoscaler.metrics_server import (INSECURE_FLAG, METRICS_TOKEN_ENV, MetricsAccess, metrics_access,
                                              metrics_app)
from kvgate.clock import RealClock
from kvgate.providers.k8s_pod_template import EnginePodTemplate, parse_engine_pod_template
from kvgate.state import REDIS_PASSWORD_ENV, StateStore, StateStoreError, open_state_store, redact_url
from kvgate.registry.problems import RegistryInvalid
from kvgate.registry.watch import RegistryWatcher

log = logging.getLogger("kvgate.autoscaler")

EPILOG = """\
Stopping (SIGTERM, Ctrl-C) releases the lease and leaves every node and replica running: the next
autoscaler of the same --cluster on the same --state adopts them. To release a fleet, set its models'
min_replicas to 0 (or remove its pools) and let the autoscaler scale it down.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate autoscaler", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Scale replicas per model from gateway queue depth and buy and release nodes across "
                    "pools by price and availability. One copy is active at a time (a lease in --state).")
    parser.add_argument("--registry", required=True, metavar="DIR", help="registry directory (hot-reloaded)")
    parser.add_argument("--state", required=True, metavar="URL",
                        help="state store shared with the gateways: redis://host:port/db, or memory:// "
                             "(this process only: for trying it out); a Redis password may come from "
                             "$KVGATE_REDIS_PASSWORD instead of the URL, out of the process's arguments")
    parser.add_argument("--cluster", default="default",
                        help="cluster name, tagged on every node bought; an autoscaler only ever touches "
                             "nodes of its own cluster (default: %(default)s)")
    parser.add_argument("--key-prefix", default="kvgate:",
                        help="key prefix in Redis, so several clusters can share one (default: %(default)s)")
    parser.add_argument("--interval-s", type=positive_float, default=1.0, help="seconds between ticks (default: 1)")
    parser.add_argument("--lease-ttl-s", type=positive_float, default=None,
                        help="a dead active copy is replaced this long after its last tick "
                             "(default: max(10, 3 x interval))")
    parser.add_argument("--holder", default=None, help="this copy's name in the lease (default: host-pid-random)")
    parser.add_argument("--engine-pod-template", default=None, metavar="FILE",
                        help="a Kubernetes pod template (YAML: metadata and spec) merged under the engine pods that "
                             "kubernetes pools create: image pull secrets, tolerations, affinity, resources, "
                             "security context... Read once at start (default: none)")
    parser.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                        help="serve /metrics (kvgate_autoscaler_*: leader, replicas desired and ready, nodes, cost, "
                             "provisioning age) and /health on this port (default: no listener)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help=f"address for --metrics-port (default: %(default)s). Beyond loopback /metrics needs "
                             f"${METRICS_TOKEN_ENV} (as the gateway's does), or {INSECURE_FLAG}")
    parser.add_argument(INSECURE_FLAG, action="store_true",
                        help="serve /metrics without a token on a --metrics-host beyond loopback (logged as a WARNING)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, not {port}")
    return port


def read_engine_pod_template(path: str) -> EnginePodTemplate:
    """The engine pod template in the YAML file `path`; ValueError naming the file and the problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    return parse_engine_pod_template(data, source=path)


class StartRefused(Exception):
    """What stops the autoscaler before it runs: printed as one line, exit `status` (2 bad input, 1 the world)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


async def serve(args: argparse.Namespace) -> int:
    clock = RealClock()
    store: StateStore | None = None
    try:
        pod_template = pod_template_of(args)
        watcher = await RegistryWatcher.open(args.registry, clock)
        store = open_store(args, clock)
        settings = autoscaler_settings(args)
        access = metrics_access(args.metrics_host, os.environ.get(METRICS_TOKEN_ENV), args.insecure_open_metrics)
        if args.metrics_port is not None and access.refusal is not None:
            raise StartRefused(access.refusal)
        factory = provider_factory_for(args.cluster, clock, engine_pod_template=pod_template)
        autoscaler = Autoscaler(watcher, store, clock, provider_factory=factory, settings=settings,
                                holder=args.holder or default_holder())
        listener = await start_metrics(args, access, autoscaler, clock)
    except (StartRefused, RegistryInvalid) as exc:
        print(f"kvgate autoscaler: {exc}", file=sys.stderr)
        if store is not None:
            await store.close()
        return exc.status if isinstance(exc, StartRefused) else 2
    try:
        holder = await store.lease_holder("autoscaler")
    except StateStoreError:  # Redis may start after this pod: no crash loop, the loop waits (a line a tick)
        holder = None
    log.info("kvgate autoscaler %s: cluster %r, registry %s (version %s), state %s%s", autoscaler.holder,
             args.cluster, args.registry, watcher.current.version, redact_url(args.state),
             f"; {holder} is active, waiting as standby" if holder else "")
    await run_until_signalled(autoscaler, watcher, store, listener)
    log.info("kvgate autoscaler %s stopped; lease released, nodes and replicas left running for the next "
             "autoscaler to adopt", autoscaler.holder)
    return 0


def pod_template_of(args: argparse.Namespace) -> EnginePodTemplate | None:
    if not args.engine_pod_template:
        return None
    try:
        return read_engine_pod_template(args.engine_pod_template)
    except ValueError as exc:
        raise StartRefused(f"--engine-pod-template {exc}") from None


def open_store(args: argparse.Namespace, clock: RealClock) -> StateStore:
    """The state store --state names; StartRefused for a URL it cannot be (its password redacted)."""
    try:
        return open_state_store(args.state, clock, prefix=args.key_prefix, password=os.environ.get(REDIS_PASSWORD_ENV))
    except ValueError as exc:
        raise StartRefused(f"--state: {str(exc).replace(args.state, redact_url(args.state))}") from None


def autoscaler_settings(args: argparse.Namespace) -> AutoscalerSettings:
    lease_ttl_s = args.lease_ttl_s or max(10.0, 3 * args.interval_s)
    try:
        return AutoscalerSettings(interval_s=args.interval_s, lease_ttl_s=lease_ttl_s,
                                  member_ttl_s=max(10.0, 3 * args.interval_s))
    except ValueError as exc:
        raise StartRefused(str(exc)) from None


async def run_until_signalled(autoscaler: Autoscaler, watcher: RegistryWatcher, store: StateStore,
                              listener: web.AppRunner | None) -> None:
    """Run the loop and the registry watch until SIGINT or SIGTERM, then stop them (the lease released, nodes and
    replicas left running) and close the listener, the providers' clients and the store."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(watcher.watch(), name="kvgate-registry-watch")
    await autoscaler.start()
    try:
        await stop.wait()
    finally:
        await autoscaler.stop()
        if listener is not None:
            await listener.cleanup()
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        for provider in autoscaler.providers.values():
            await provider.close()  # closes clients only: nodes and replicas keep running
        await store.close()


async def start_metrics(args: argparse.Namespace, access: MetricsAccess, autoscaler: Autoscaler,
                        clock: RealClock) -> web.AppRunner | None:
    """The /metrics listener when --metrics-port asks for one (its runner, to clean up), else None."""
    if args.metrics_port is None:
        return None
    registry = autoscaler_registry(autoscaler.reading, clock.wall)
    runner = web.AppRunner(metrics_app(registry, access.token, lambda: autoscaler.running), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.metrics_host, args.metrics_port).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartRefused(f"cannot listen on {args.metrics_host}:{args.metrics_port}: {exc.strerror or exc}",
                           status=1) from None
    if access.notice is not None:
        log.log(*access.notice)
    return runner


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
