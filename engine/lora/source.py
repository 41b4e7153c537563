"""Adapter sources: a local directory, used in place, s3://bucket/prefix, downloaded into the cache, or a
built-in demo adapter, written into the cache (engine.lora.builtin).

    fetch_adapter("/adapters/sql-lora", cache)          -> /adapters/sql-lora
    fetch_adapter("s3://adapters/sql-lora", cache)      -> <cache>/adapters/<sha256(url)[:16]>/<version>
    fetch_adapter("builtin:smollm2-demo-a", cache)      -> <cache>/adapters/builtin/smollm2-demo-a-v1

The S3 endpoint is, first found: the `endpoint_url` argument, $KVGATE_S3_ENDPOINT_URL, $AWS_ENDPOINT_URL,
else AWS itself. Credentials and region come from boto3's usual chain (environment, profile, instance role).
boto3 is imported only when an s3:// source is fetched.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvgate.engine.lora.builtin import builtin_adapter_dir
from kvgate.engine.lora.errors import AdapterLoadError
from kvgate.engine.lora.peft import CONFIG_FILE, WEIGHTS_FILE

S3_SCHEME = "s3://"
BUILTIN_PREFIX = "builtin:"
ENDPOINT_ENV_VARS = ("KVGATE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")


def s3_endpoint_url(explicit: str | None = None) -> str | None:
    """The endpoint to use: `explicit`, else the first environment variable of ENDPOINT_ENV_VARS set."""
    if explicit:
        return explicit
    return next((os.environ[var] for var in ENDPOINT_ENV_VARS if os.environ.get(var)), None)


def fetch_adapter(source: str, cache_dir: Path, endpoint_url: str | None = None) -> Path:
    """The local directory holding the adapter at `source`, downloading it if it is remote. Does not
    validate the files (engine.lora.peft does). Safe to call from several threads and processes.
    Raises AdapterLoadError for a missing directory, an unsupported scheme or a failed download."""
    if source.startswith(S3_SCHEME):
        from kvgate.engine.lora.s3 import download_s3_files  # boto3 loads only for S3 sources

        root = Path(cache_dir) / "adapters" / hashlib.sha256(source.encode()).hexdigest()[:16]
        return download_s3_files(source, (CONFIG_FILE, WEIGHTS_FILE), root, s3_endpoint_url(endpoint_url))
    if source.startswith(BUILTIN_PREFIX):
        return builtin_adapter_dir(source.removeprefix(BUILTIN_PREFIX), Path(cache_dir))
    if "://" in source:
        raise AdapterLoadError(f"{source}: unsupported scheme; an adapter source is a local directory, "
                               f"s3://bucket/prefix or builtin:NAME")
    path = Path(source).expanduser()
    if not path.is_dir():
        raise AdapterLoadError(f"{source}: no such adapter directory")
    return path
