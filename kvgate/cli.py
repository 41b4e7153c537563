"""The `kvgate` command: one entry point whose subcommands wrap each part's `python -m` entry."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

from kvgate import __version__
from kvgate import keys as keys_cli
from kvgate.registry import cli as registry_cli
from kvgate.registry.tenant import KEY_SECRET_ENV


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="kvgate: a cache-aware, multi-cloud inference router and autoscaler for LLM fleets.",
    )
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    registry = commands.add_parser(
        "registry", help="validate, diff (plan) and export the schema of a registry",
        description="Config-as-code tooling for a registry of Model, Adapter, Pool and Tenant documents.")
    registry_cli.configure(registry)
    registry.set_defaults(run=registry_cli.run)
    keys = commands.add_parser(
        "keys", help="create API keys for the registry's Tenants",
        description=f"API keys for Tenants: the registry holds each key's HMAC under ${KEY_SECRET_ENV}, never the key.")
    keys_cli.configure(keys)
    keys.set_defaults(run=keys_cli.run)
    for name, (module, help_text, whose) in FORWARDED.items():
        forwarded = commands.add_parser(name, add_help=False, help=help_text,
                                        description=f"Run `kvgate {name} --help` for {whose} options.")
        forwarded.set_defaults(run=functools.partial(_run_forwarded, module))
    return parser


# Subcommands that hand everything after their name to that part's own `main(argv)` (`kvgate engine --help`
# lists the engine's options): name -> (module, one-line help, whose options). The module is imported
# only when its subcommand runs, so that the other subcommands never import torch.
FORWARDED = {
    "engine": ("kvgate.engine.server.main", "serve one model over the OpenAI API (a replica)", "the replica server's"),
    "router": ("kvgate.router.main", "run the cache-aware OpenAI gateway", "the gateway's"),
    "autoscaler": ("kvgate.autoscaler.main", "run the control loops: replicas per model, nodes per pool",
                   "the autoscaler's"),
    "up": ("kvgate.stack", "run the whole stack on this machine: gateway, autoscaler, engine replicas", "its"),
    "sim": ("kvgate.autoscaler.sim.cli", "replay a request trace against the autoscaler and baselines",
            "the simulator's"),
}


def _run_forwarded(module_name: str, args: argparse.Namespace) -> int:
    return importlib.import_module(module_name).main(args.forwarded)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in FORWARDED:
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
