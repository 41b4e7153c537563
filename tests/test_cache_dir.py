"""The suite keeps its builtin models in the checkout's cache (tests/conftest.py), not in the user's
~/.cache/kvgate, and every process a test starts finds the same cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvgate.engine.builtin import default_cache_dir
from tests.engine.builtin_cache import shared_cache_dir


def test_the_suite_and_the_processes_it_starts_share_one_cache_that_is_not_the_users() -> None:
    assert default_cache_dir() == shared_cache_dir()  # what the engine picks with no --cache-dir
    code = "from kvgate.engine.builtin import default_cache_dir; print(default_cache_dir())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert child.stdout.strip() == str(shared_cache_dir())
    assert default_cache_dir() != Path.home() / ".cache" / "kvgate"
