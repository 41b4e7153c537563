"""Fixtures shared by every suite: real external services, started once per test session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redis_answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `redis-server` on a free loopback port for the whole session; yields its URL.

    No persistence (`--save ''`, no AOF): every session starts empty. Tests isolate themselves with
    a unique key prefix. A missing binary fails the tests that need it, never skips them.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server not found; `make test` installs it", pytrace=False)
    port = free_loopback_port()
    workdir = tmp_path_factory.mktemp("redis")
    log_path = workdir / "redis.log"
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    command += ["--dir", str(workdir), "--logfile", str(log_path)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10.0  # a cold start takes ~10 ms; 10 s is for loaded CI hosts
        while not _redis_answers_ping(port):
            if process.poll() is not None or time.monotonic() > deadline:
                log = log_path.read_text() if log_path.exists() else ""
                pytest.fail(f"redis-server on port {port} did not start:\n{log}", pytrace=False)
            time.sleep(0.01)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, with an error status
    except OSError:
        return False


@pytest.fixture(scope="session")
def moto_endpoint_url() -> Iterator[str]:
    """A real `moto` server (S3, EC2, ... APIs) on a free loopback port for the whole session; yields its
    endpoint URL. State is in memory: tests isolate themselves with unique bucket names. Clients need
    credentials, any will do: use the `moto_credentials` fixture."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30.0  # ~1 s to import moto on a quiet host
        while not _http_answers(url + "/moto-api/"):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                stderr = process.communicate()[1].decode(errors="replace")
                pytest.fail(f"moto server on port {port} did not start:\n{stderr[-2000:]}", pytrace=False)
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def moto_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake AWS credentials and region for clients of the moto server, never real ones."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_SESSION_TOKEN", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "KVGATE_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
