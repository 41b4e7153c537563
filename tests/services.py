"""Starting real server processes for tests: a free loopback port, and a process that is stopped for
sure once the test is done, failing (never skipping) when it does not come up."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


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
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
