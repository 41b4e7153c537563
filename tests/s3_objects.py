"""Buckets and uploads on the session's moto S3 server, for tests that load models or adapters from s3://."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3


def new_bucket(endpoint_url: str, prefix: str) -> str:
    """A fresh, uniquely named bucket (tests share one moto server)."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=name)
    return name


def upload_dir(endpoint_url: str, bucket: str, prefix: str, directory: Path) -> None:
    """Every file directly in `directory` as `prefix/<file name>`."""
    s3 = boto3.client("s3", endpoint_url=endpoint_url)
    for path in directory.iterdir():
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.name}")
