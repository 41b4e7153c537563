"""`kvgate up` as a real subprocess for the end-to-end tests: start it on a registry, read its log, find
its descendants in /proc, and make sure nothing it started outlives a test (even a failing one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.providers.local_proc import proc_stat
from tests.engine.builtin_cache import shared_cache_dir

REPO = Path(__file__).resolve().parents[2]


@dataclass
class UpProcess:
    process: subprocess.Popen[bytes]
    url: str  # the gateway, http://127.0.0.1:PORT
    log_path: Path
    work_dir: Path  # the local pool's work_dir: nodes/ and replicas/ (pid files)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get_json(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return json.load(response)

    def replica_records(self, model: str | None = None) -> list[dict[str, Any]]:
        """The local provider's pid files (one per replica it runs)."""
        records = []
        for path in sorted((self.work_dir / "replicas").glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # removed while we read
            if model is None or record.get("model") == model:
                records.append(record)
        return records

    def descendants(self) -> list[tuple[int, int]]:
        """(pid, start ticks) of every live process below kvgate up (engines run in their own sessions
        but are still its children)."""
        return descendants_of(self.process.pid)


def descendants_of(root: int) -> list[tuple[int, int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), 0)
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], list(children.get(root, ()))
    while stack:
        pid = stack.pop()
        stat = proc_stat(pid)
        if stat is not None and stat.state not in ("Z", "X"):
            found.append((pid, stat.start_ticks))
        stack.extend(children.get(pid, ()))
    return found


def alive(pid: int, start_ticks: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and stat.state not in ("Z", "X")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def run_up(registry: Path, port: int, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start `kvgate up` (output to `log_path`, the builtin models from the repo's shared cache)."""
    command = [sys.executable, "-m", "kvgate.cli", "up", "--registry", str(registry), "--port", str(port),
               "--cache-dir", str(shared_cache_dir()), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def start_up(registry: Path, port: int, log_path: Path, work_dir: Path, timeout_s: float = 60.0) -> UpProcess:
    """`kvgate up` with its gateway answering /health; fails with the log if it exits or times out."""
    process = run_up(registry, port, log_path)
    up = UpProcess(process, f"http://127.0.0.1:{port}", log_path, work_dir)
    deadline = time.monotonic() + timeout_s
    while not _answers(up.url + "/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_for_sure(up)
            raise AssertionError(f"kvgate up did not start:\n{up.log()[-3000:]}")
        time.sleep(0.1)
    return up


def stop_for_sure(up: UpProcess) -> None:
    """Teardown: SIGTERM, SIGKILL after 30 s, then SIGKILL anything it left (a failing test leaks nothing)."""
    leftovers = up.descendants() if up.process.poll() is None else []
    if up.process.poll() is None:
        up.process.send_signal(signal.SIGTERM)
        try:
            up.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.process.kill()
            up.process.wait()
    for pid, ticks in leftovers:
        if alive(pid, ticks):
            os.kill(pid, signal.SIGKILL)
