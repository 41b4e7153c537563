"""`kvgate registry validate | plan | schema`: config-as-code tooling for CI and people.

Exit codes: 0 success; 1 the registry (or one of two) is invalid; 2 usage errors (argparse), and
`plan --detailed-exitcode` also uses 2 for "valid, with changes" so CI can tell the cases apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from pydantic import TypeAdapter

from kvgate.registry.loader import load_registry
from kvgate.registry.plan import plan, render, to_json
from kvgate.registry.problems import RegistryInvalid
from kvgate.registry.schema import API_VERSION, Document
from kvgate.registry.snapshot import Snapshot

SCHEMA_ID = "https://kvgate.dev/schemas/registry-v1.json"


def registry_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) accepting any one registry document of any kind."""
    schema = TypeAdapter(Document).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": f"kvgate registry document ({API_VERSION})",
        "description": "One YAML document of a kvgate registry: a Model, Adapter, Pool or Tenant.",
        **schema,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the registry subcommands to `parser` (used by `kvgate registry` and `python -m kvgate.registry`)."""
    commands = parser.add_subparsers(dest="registry_command", metavar="COMMAND", required=True)

    validate = commands.add_parser(
        "validate", help="check registry directories; list every problem with file:line",
        description="Load and check each registry directory (or file). Every problem in it is listed as "
                    "FILE:LINE: KIND/NAME: KEY.PATH: message. Exit 0 when all are valid, 1 otherwise.")
    validate.add_argument("sources", nargs="+", metavar="DIR", help="registry directory or YAML file")
    validate.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    validate.set_defaults(func=_validate)

    plan_cmd = commands.add_parser(
        "plan", help="show what changes between two registries (terraform-style)",
        description="Compare the effective configuration of two registries document by document. "
                    "With one argument, compare against an empty registry (a first deployment). "
                    "Values that came from ${ENV_VAR} are shown as (sensitive).")
    plan_cmd.add_argument("sources", nargs="+", metavar="DIR", help="[OLD] NEW registry directories")
    plan_cmd.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_cmd.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    plan_cmd.add_argument("--detailed-exitcode", action="store_true",
                          help="exit 0 for no changes, 2 for changes, 1 for invalid registries")
    plan_cmd.set_defaults(func=_plan)

    schema = commands.add_parser(
        "schema", help="print the JSON Schema of registry documents",
        description="Print a JSON Schema (draft 2020-12) of all document kinds, for editors: e.g. put "
                    "'# yaml-language-server: $schema=registry.schema.json' at the top of a YAML file.")
    schema.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    schema.set_defaults(func=_schema)


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    return args.func(args, out, err)


def _load(source: str, err: TextIO) -> Snapshot | None:
    try:
        return load_registry(source)
    except RegistryInvalid as exc:
        print(f"error: {exc}", file=err)
        return None


def _validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    status = 0
    for source in args.sources:
        snapshot = _load(source, err)
        if snapshot is None:
            status = 1
        elif not args.quiet:
            counts = ", ".join(f"{n} {kind}{'' if n == 1 else 's'}" for kind, n in snapshot.counts().items())
            print(f"{source}: valid ({counts}); version {snapshot.version}", file=out)
    return status


def _plan(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if len(args.sources) > 2:
        print("error: plan takes [OLD] NEW: one or two registry directories", file=err)
        return 1
    old = Snapshot.empty() if len(args.sources) == 1 else _load(args.sources[0], err)
    new = _load(args.sources[-1], err)
    if old is None or new is None:
        return 1
    result = plan(old, new)
    if args.json:
        print(json.dumps(to_json(result), indent=2), file=out)
    else:
        color = args.color == "always" or (args.color == "auto" and out.isatty())
        print(render(result, color=color), file=out)
    return 2 if args.detailed_exitcode and result.has_changes else 0


def _schema(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    text = json.dumps(registry_json_schema(), indent=2) + "\n"
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:
            print(f"error: cannot write {args.output}: {exc.strerror}", file=err)
            return 1
    else:
        out.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.registry", description="kvgate registry tooling")
    configure(parser)
    return run(parser.parse_args(argv))
