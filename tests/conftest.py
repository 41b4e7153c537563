"""Fixtures shared by every suite: real external services, started once per test session; and the cache
directory of the whole run."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.engine.builtin import CACHE_DIR_ENV
from tests.engine.builtin_cache import shared_cache_dir
from tests.services import free_loopback_port, http_answers, redis_server, running
from tests.slurm_cluster import SlurmCluster, slurm_cluster as start_slurm_cluster


def pytest_configure(config: pytest.Config) -> None:
    """Builtin models, downloads and adapters go to the checkout's own gitignored cache (`.kvgate-cache`),
    never to the user's ~/.cache/kvgate: a rerun reuses what the last run built. Set in the environment
    before any test runs, so every engine, `kvgate up` and autoscaler process a test starts inherits it.
    A KVGATE_CACHE_DIR set by the caller (CI sharing one cache between checkouts) is kept."""
    os.environ.setdefault(CACHE_DIR_ENV, str(shared_cache_dir()))


@pytest.fixture(scope="session", autouse=True)
def paged_attention_kernel() -> None:
    """The engine's compiled CPU attention kernel, built (once per cache, about 20 s) before any test runs, so
    that every engine a test starts, in this process or as a subprocess sharing the cache, attends through it
    from its first step rather than switching when a background build lands. No compiler fails the session:
    CI installs g++ (the Makefile's SYSTEM_DEPS). Tests of the gather path ask for attention_kernel="off"."""
    import torch

    from kvgate.engine.runner.kernels import KernelLoader

    loader = KernelLoader("wait", torch.device("cpu"))
    assert loader.paged_attention is not None, f"the paged-attention kernel is {loader.status}"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `redis-server` on a free loopback port for the whole session; yields its URL.

    No persistence (`--save ''`, no AOF): every session starts empty. Tests isolate themselves with
    a unique key prefix. A missing binary fails the tests that need it, never skips them.
    """
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def moto_endpoint_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `moto` server (S3, EC2, ... APIs) on a free loopback port for the whole session; yields its
    endpoint URL. State is in memory: tests isolate themselves with unique bucket names. Clients need
    credentials, any will do: use the `moto_credentials` fixture."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    url = f"http://127.0.0.1:{port}"
    # ~1 s to import moto on a quiet host
    with running(command, name=f"moto server on port {port}", ready=lambda: http_answers(url + "/moto-api/"),
                 timeout_s=30.0, log_path=tmp_path_factory.mktemp("moto") / "moto.log"):
        yield url


@pytest.fixture
def moto_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake AWS credentials and region for clients of the moto server, never real ones."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_SESSION_TOKEN", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "KVGATE_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real single-node Slurm cluster (munged, slurmctld, slurmd as root; four fake H100s; partitions
    `inference` and preemptible `training`) for the whole session: tests/slurm_cluster.py. Tests cancel
    their jobs when they end (`SlurmCluster.clean`). Its folder is readable by every user (pytest's own are
    not), so a test can submit as another user through the cluster's slurm.conf and munge socket."""
    root = Path(tempfile.mkdtemp(prefix="kvgate-slurm-"))
    root.chmod(0o755)
    try:
        with start_slurm_cluster(root) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)
