"""Starting real server processes for tests: a free loopback port, and a process that is stopped for
sure once the test is done, failing (never skipping) when it does not come up."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def kvgate_command() -> list[str]:
    """The `kvgate` command of the interpreter running the tests (its venv's script, else `-m kvgate.cli`)."""
    script = Path(sys.executable).with_name("kvgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvgate.cli"]


def checkov_command() -> list[str]:
    """checkov, which `make setup` installs in a venv of its own beside the tests' (`<venv>/tools/checkov`: it
    pins an old boto3). A missing one fails the test that needs it, never skips it."""
    path = Path(sys.prefix) / "tools" / "checkov" / "bin" / "checkov"
    if not path.exists():
        pytest.fail(f"checkov is not installed at {path}: run `make setup`", pytrace=False)
    return [str(path)]


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running(command: list[str], *, name: str, ready: Callable[[], bool], timeout_s: float,
            log_path: Path) -> Iterator[subprocess.Popen]:
    """Run `command` until the block ends (SIGTERM, then SIGKILL after 5 s), its output going to
    `log_path` (a file, not a pipe nobody reads, which would block a chatty server once it fills).
    Waits until `ready()`; if the process exits or `timeout_s` passes first, the test fails with the
    end of the log."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                pytest.fail(f"{name} did not start:\n{tail}", pytrace=False)
            time.sleep(0.02)
        yield process
    finally:
        stop_process(process, timeout_s=5.0)


def stop_process(process: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM (a kvgate command drains and exits 0), then SIGKILL if it is still there after `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def http_answers(url: str) -> bool:
    """True when something answers GET `url` over HTTP, with any status."""
    try:
        with urllib.request.urlopen(url, timeout=0.5):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, with an error status
    except OSError:
        return False


def _ping_reply(port: int) -> bytes:
    """What a redis-server on loopback `port` answers an unauthenticated PING with (b"" when none answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)
    except OSError:
        return b""


def asks_for_a_password(port: int) -> bool:
    """A redis-server with a password answers an unauthenticated PING with -NOAUTH: it is up."""
    return _ping_reply(port).startswith(b"-NOAUTH")


def redis_answers_ping(port: int) -> bool:
    return _ping_reply(port).startswith(b"+PONG")


@contextmanager
def redis_server(workdir: Path, port: int | None = None) -> Iterator[str]:
    """A real `redis-server` on a loopback port (free, unless given) until the block ends; yields its URL.

    No persistence (`--save ''`, no AOF): it starts empty, and starts empty again if restarted on the same
    port. A missing binary fails the test, never skips it."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server not found; `make test` installs it", pytrace=False)
    port = port or free_loopback_port()
    log_path = workdir / "redis.log"
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    command += ["--dir", str(workdir), "--logfile", str(log_path)]
    # a cold start takes ~10 ms; 10 s is for loaded CI hosts
    with running(command, name=f"redis-server on port {port}", ready=lambda: redis_answers_ping(port),
                 timeout_s=10.0, log_path=log_path):
        yield f"redis://127.0.0.1:{port}/0"
