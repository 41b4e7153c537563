"""The `kvgate` command: one entry point whose subcommands wrap each part's `python -m` entry."""

from __future__ import annotations

import argparse
import sys

from registry import cli as registry_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="kvgate: a cache-aware, multi-cloud inference router and autoscaler for LLM fleets.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    registry = commands.add_parser(
        "registry", help="validate, diff (plan) and export the schema of a registry",
        description="Config-as-code tooling for a registry of Model, Adapter, Pool and Tenant documents.")
    registry_cli.configure(registry)
    registry.set_defaults(run=registry_cli.run)
    # Everything after `engine` (or `router`) is that part's own (`kvgate engine --help` lists it); parsed there so
    # that the other subcommands never import torch.
    engine = commands.add_parser(
        "engine", add_help=False, help="serve one model over the OpenAI API (a replica)",
        description="Run `kvgate engine --help` for the replica server's options.")
    engine.set_defaults(run=_run_engine)
    router = commands.add_parser(
        "router", add_help=False, help="run the cache-aware OpenAI gateway",
        description="Run `kvgate router --help` for the gateway's options.")
    router.set_defaults(run=_run_router)
    autoscaler = commands.add_parser(
        "autoscaler", add_help=False, help="run the control loops: replicas per model, nodes per pool",
        description="Run `kvgate autoscaler --help` for the autoscaler's options.")
    autoscaler.set_defaults(run=_run_autoscaler)
    up = commands.add_parser(
        "up", add_help=False, help="run the whole stack on this machine: gateway, autoscaler, engine replicas",
        description="Run `kvgate up --help` for its options.")
    up.set_defaults(run=_run_up)
    sim = commands.add_parser(
        "sim", add_help=False, help="replay a request trace against the autoscaler and baselines",
        description="Run `kvgate sim --help` for the simulator's options.")
    sim.set_defaults(run=_run_sim)
    return parser


def _run_engine(args: argparse.Namespace) -> int:
    from engine.server.main import main as engine_main

    return engine_main(args.forwarded)


def _run_router(args: argparse.Namespace) -> int:
    from router.main import main as router_main

    return router_main(args.forwarded)


def _run_autoscaler(args: argparse.Namespace) -> int:
    from autoscaler.main import main as autoscaler_main

    return autoscaler_main(args.forwarded)


def _run_up(args: argparse.Namespace) -> int:
    from kvgate.stack import main as up_main

    return up_main(args.forwarded)


def _run_sim(args: argparse.Namespace) -> int:
    from autoscaler.sim.cli import main as sim_main

    return sim_main(args.forwarded)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("engine", "router", "autoscaler", "up", "sim"):
        args.forwarded = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvgate registry schema | head`: the reader left; not an error of ours
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
