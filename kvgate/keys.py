"""`kvgate keys`: API keys for the registry's Tenants.

    kvgate keys create --tenant NAME   a new random key, printed once, and the registry line that admits it
    kvgate keys hash --tenant NAME     the registry line for an existing key read from stdin (migrating from
                                       api_key_sha256, or re-hashing under a new secret)

Both need the gateways' secret in $KVGATE_KEY_SECRET: the registry holds HMAC-SHA256(secret, key), never the key
(`registry.tenant`). Nothing is written anywhere; the key is on stdout only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Mapping
from typing import TextIO

from pydantic import ValidationError

from kvgate.registry.schema import Metadata
from kvgate.registry.tenant import KEY_SECRET_ENV, key_hmac, key_secret_problem

# What every key starts with, so that secret scanners (and people) recognise one in a paste or a commit.
KEY_PREFIX = "kvg_"
KEY_RANDOM_BYTES = 32  # 256 bits from `secrets`: no guessing, whatever the rate limits


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def registry_line(secret: bytes, api_key: str) -> str:
    """The line of a Tenant's spec that admits `api_key`."""
    return f'api_key_hmac: "{key_hmac(secret, api_key)}"'


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    for name, help_text in (("create", "print a new API key once, and the registry line that admits it"),
                            ("hash", "print the registry line for a key read from stdin")):
        action = actions.add_parser(name, help=help_text, description=help_text + f" (needs ${KEY_SECRET_ENV})")
        action.add_argument("--tenant", required=True, metavar="NAME", help="the Tenant's metadata.name")


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None, stdin: TextIO | None = None,
        stdout: TextIO | None = None) -> int:
    """`kvgate keys ACTION`; 2 with one line on stderr without a usable secret or a valid tenant name."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    secret = (os.environ if environ is None else environ).get(KEY_SECRET_ENV, "")
    problem = key_secret_problem(secret)
    if problem is not None:
        print(f"kvgate keys: {problem}; it must be the secret your gateways have", file=sys.stderr)
        return 2
    try:
        Metadata(name=args.tenant)
    except ValidationError as exc:
        print(f"kvgate keys: --tenant: {exc.errors()[0]['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    if args.keys_action == "create":
        key = new_key()
        print(f"# API key of Tenant/{args.tenant}, shown this once: give it to the tenant (the OpenAI SDK's "
              "api_key); kvgate keeps only its HMAC.", key, sep="\n", file=stdout)
    else:
        key = stdin.readline().strip()
        if not key:
            print("kvgate keys hash: no key on stdin", file=sys.stderr)
            return 2
    print(f"# In the registry, Tenant/{args.tenant}'s spec:", "  " + registry_line(secret.encode(), key),
          sep="\n", file=stdout)
    return 0
