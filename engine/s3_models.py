"""Model directories from S3 or an S3-compatible store (MinIO, moto): s3://bucket/prefix -> a local copy,
fetched with parallel ranged reads into a cache keyed by content.

    <cache>/models/s3/<sha256(url)[:16]>/<version>/    version = sha256(url, every object's key, size, ETag)[:16]

The objects directly under the prefix are the model's files (config.json, tokenizer files, *.safetensors, ...).
A start whose objects are unchanged finds its copy after one LIST request and downloads nothing; a changed
model gets a new version folder, so a replica never reads a file that is being rewritten. A fetch writes into
a private folder beside the cache and renames it into place when every byte has arrived: a crash or a
concurrent fetch never exposes half a model.

Each file is cut into parts of `part_bytes`, fetched by `workers` threads as HTTP Range GETs and written at their
offsets (os.pwrite) into the preallocated file, which is what Run:ai's model streamer and s5cmd do to reach a
store's bandwidth from one client. Each GET carries If-Match with the listed ETag: an object replaced during the
fetch fails it rather than mixing two versions. loadtests/bench_cold_start.py --s3 measures it beside boto3's
own parallel download of the same object.

boto3 is imported only when an s3:// model is fetched.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from kvgate.engine.builtin import ModelSourceError

log = logging.getLogger("kvgate.engine.s3")

S3_SCHEME = "s3://"
PART_BYTES = 16 << 20
WORKERS = 16
PART_ATTEMPTS = 3


@dataclass(frozen=True)
class S3Object:
    name: str  # the file name under the prefix
    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class FetchStats:
    """What a fetch did: bytes downloaded (0 when the cache had the version) and seconds it took."""

    path: Path
    downloaded_bytes: int
    seconds: float
    cached: bool


def split_s3_url(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
    if not url.startswith(S3_SCHEME) or not bucket:
        raise ModelSourceError(f"{url}: not an S3 URL; expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


def version_of(url: str, objects: list[S3Object]) -> str:
    """The cache folder's name for this content: any changed, added or removed object changes it."""
    lines = [url, *(f"{o.name}\t{o.size}\t{o.etag}" for o in sorted(objects, key=lambda o: o.name))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """[(first byte, last byte)] covering 0 .. size - 1, inclusive as HTTP ranges are; none for an empty file."""
    return [(start, min(start + part_bytes, size) - 1) for start in range(0, size, part_bytes)]


def fetch_s3_model(url: str, cache_dir: Path, endpoint_url: str | None = None, *, workers: int = WORKERS,
                   part_bytes: int = PART_BYTES, clock: Callable[[], float] = time.perf_counter) -> FetchStats:
    """The local directory holding the model at `url`, downloading it unless the cache has this version.
    Raises ModelSourceError naming the URL: nothing under the prefix, no config.json, a missing bucket,
    denied access, no credentials, an unreachable endpoint, an object changed during the fetch."""
    import boto3
    from botocore.config import Config

    started = clock()
    bucket, prefix = split_s3_url(url)
    client = boto3.client("s3", endpoint_url=endpoint_url, config=Config(
        connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"},
        max_pool_connections=workers))
    objects = _call(url, endpoint_url, lambda: _list(client, bucket, prefix))
    if not objects:
        raise ModelSourceError(f"{url}: no objects under this prefix")
    if "config.json" not in {o.name for o in objects}:
        raise ModelSourceError(f"{url}: not a Hugging Face model (no config.json under the prefix)")
    root = Path(cache_dir) / "models" / "s3" / hashlib.sha256(url.encode()).hexdigest()[:16]
    target = root / version_of(url, objects)
    if target.is_dir():
        return FetchStats(target, 0, clock() - started, cached=True)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    try:
        total = sum(o.size for o in objects)
        log.info("fetching %s: %d files, %.0f MB, %d parallel ranged reads", url, len(objects), total / 1e6, workers)
        progress = _Progress(url, total, clock)
        _call(url, endpoint_url, lambda: _download(client, bucket, objects, work, workers, part_bytes, progress))
        work.chmod(0o755)  # mkdtemp made it private; a cache may be shared
        try:
            os.rename(work, target)
        except OSError:  # a concurrent fetch of this version finished first; its copy is the same bytes
            if not target.is_dir():
                raise
        seconds = clock() - started
        log.info("fetched %s in %.2f s (%.2f GB/s)", url, seconds, total / seconds / 1e9 if seconds else 0.0)
        return FetchStats(target, total, seconds, cached=False)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _list(client, bucket: str, prefix: str) -> list[S3Object]:
    objects = []
    start = f"{prefix}/" if prefix else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start, Delimiter="/"):
        for item in page.get("Contents", []):
            name = item["Key"][len(start):]
            if not name:  # the prefix's own placeholder object
                continue
            if "/" in name or "\\" in name or name in (".", ".."):  # a store that ignored Delimiter
                raise ModelSourceError(f"s3://{bucket}/{item['Key']}: not a file name directly under the prefix")
            objects.append(S3Object(name, item["Key"], int(item["Size"]), item["ETag"]))
    return objects


def _download(client, bucket: str, objects: list[S3Object], work: Path, workers: int, part_bytes: int,
              progress: _Progress) -> None:
    """Every part of every object, `workers` at a time. The first failure stops the rest: parts not started are
    cancelled and parts under way stop at their next chunk, so a denied request or a full disk fails in seconds,
    not after the whole model downloaded."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ReadTimeoutError, ResponseStreamingError

    stop = threading.Event()
    descriptors = {}
    try:
        for obj in objects:
            descriptors[obj.name] = fd = os.open(work / obj.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, obj.size)

        def read_part(obj: S3Object, first: int, last: int) -> None:
            body = client.get_object(Bucket=bucket, Key=obj.key, Range=f"bytes={first}-{last}",
                                     IfMatch=obj.etag)["Body"]
            offset = first
            for chunk in body.iter_chunks(1 << 20):
                if stop.is_set():
                    return
                os.pwrite(descriptors[obj.name], chunk, offset)
                offset += len(chunk)
            if offset != last + 1:
                raise OSError(f"{obj.key}: bytes {first}-{last} ended after {offset - first} bytes")

        def fetch(obj: S3Object, first: int, last: int) -> None:
            # botocore retries a request, not a body cut off while it is read: a dropped connection retries the
            # part (If-Match still pins the version) instead of failing the model.
            for attempt in range(PART_ATTEMPTS):
                if stop.is_set():
                    return
                try:
                    read_part(obj, first, last)
                    break
                except (ResponseStreamingError, ReadTimeoutError, BotoConnectionError) as exc:
                    if attempt + 1 == PART_ATTEMPTS:
                        raise
                    log.info("%s bytes %d-%d: %s; reading the part again", obj.key, first, last, exc)
            progress.add(last + 1 - first)

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvgate-s3") as pool:
            futures = [pool.submit(fetch, obj, first, last)
                       for obj in objects for first, last in part_ranges(obj.size, part_bytes)]
            try:
                for future in as_completed(futures):
                    future.result()  # re-raises a part's failure
            except BaseException:
                stop.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        for fd in descriptors.values():
            os.close(fd)


class _Progress:
    """Logs the fetch's progress at most every two seconds, from whichever worker thread crosses the mark."""

    def __init__(self, url: str, total: int, clock: Callable[[], float]) -> None:
        self._url, self._total, self._clock = url, total, clock
        self._done = 0
        self._started = self._last = clock()
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self._done += count
            now = self._clock()
            if now - self._last < 2.0 or self._done >= self._total:
                return
            self._last = now
            log.info("fetching %s: %.0f of %.0f MB (%.2f GB/s)", self._url, self._done / 1e6, self._total / 1e6,
                     self._done / (now - self._started) / 1e9)


def _call(url: str, endpoint_url: str | None, fn):
    from botocore.exceptions import BotoCoreError, ClientError

    where = url + (f" (endpoint {endpoint_url})" if endpoint_url else "")
    try:
        return fn()
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound"):
            raise ModelSourceError(f"{where}: not found ({code})") from exc
        if code in ("412", "PreconditionFailed"):
            raise ModelSourceError(f"{where}: an object changed during the fetch; start again") from exc
        raise ModelSourceError(f"{where}: {code or 'error'}: {error.get('Message', exc)}") from exc
    except (BotoCoreError, OSError) as exc:  # no credentials, endpoint unreachable, disk full
        raise ModelSourceError(f"{where}: {exc}") from exc
