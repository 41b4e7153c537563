"""Download an adapter's files from S3 or an S3-compatible store (MinIO, moto) with boto3. The only
module of the engine that imports boto3, and only when an s3:// source is fetched.

Each download lands in a directory named for the source and the objects' ETags:
<root>/<version>/, where version = sha256(url, ETags)[:16]. Fetching an unchanged adapter again
reuses the directory without downloading; a changed one gets a new directory, so an adapter loaded
from the old copy is never rewritten under it. A download is written to a temporary directory and
renamed into place when complete, so a crash or a concurrent fetch never exposes half a directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvgate.engine.lora.errors import AdapterLoadError

S3_SCHEME = "s3://"
# Fail a dead endpoint in seconds rather than after botocore's default of 5 attempts of 60 s.
_CLIENT_CONFIG = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"})


def split_s3_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix"). Raises AdapterLoadError without a bucket."""
    bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
    if not url.startswith(S3_SCHEME) or not bucket:
        raise AdapterLoadError(f"{url}: not an S3 URL; expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


def download_s3_files(url: str, files: tuple[str, ...], root: Path, endpoint_url: str | None) -> Path:
    """Download `files` from under the prefix `url` into a version directory below `root`; returns it.
    Raises AdapterLoadError for a missing object, denied access, bad credentials or an unreachable endpoint,
    naming the object's URL."""
    bucket, prefix = split_s3_url(url)
    keys = [f"{prefix}/{name}" if prefix else name for name in files]
    client = boto3.client("s3", endpoint_url=endpoint_url, config=_CLIENT_CONFIG)
    etags = [_call(lambda key=key: client.head_object(Bucket=bucket, Key=key)["ETag"], bucket, key, endpoint_url)
             for key in keys]
    version = hashlib.sha256("\n".join([url, *etags]).encode()).hexdigest()[:16]
    target = root / version
    if all((target / name).is_file() for name in files):
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=root))
    try:
        for name, key in zip(files, keys):
            _call(lambda key=key, name=name: client.download_file(bucket, key, str(work / name)), bucket, key,
                  endpoint_url)
        work.chmod(0o755)
        try:
            os.rename(work, target)
        except OSError:  # a concurrent fetch of the same version finished first; its copy is identical
            if not target.is_dir():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


def _call(fn, bucket: str, key: str, endpoint_url: str | None):
    where = f"s3://{bucket}/{key}" + (f" (endpoint {endpoint_url})" if endpoint_url else "")
    try:
        return fn()
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound"):
            raise AdapterLoadError(f"{where}: not found") from exc
        raise AdapterLoadError(f"{where}: {exc}") from exc
    except (BotoCoreError, OSError) as exc:  # no credentials, endpoint unreachable, disk full
        raise AdapterLoadError(f"{where}: {exc}") from exc
