"""Model sources: a local Hugging Face directory, or a builtin model materialized into a cache.

    resolve_model_source("builtin:tiny-llama")     -> <cache>/models/tiny-llama-v1
    resolve_model_source("builtin:smollm2-135m")   -> <cache>/models/smollm2-135m-v1
    resolve_model_source("/models/llama-3-8b")     -> the directory itself
    resolve_model_source("s3://bucket/prefix")     -> <cache>/models/s3/<url hash>/<version> (engine/s3_models.py)

A builtin is built once per cache directory, in a temporary directory beside its final place and
renamed into place when complete, under a file lock: concurrent processes wait for the one that
builds, and nobody ever sees a half-written directory. The name carries a format version (`-v1`) so
a change to what a builtin holds builds a new directory instead of trusting an old one.

Plain Python at import; torch, gguf and the converters load inside the builders that need them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType

from kvgate.engine.builtin_models import build_smollm2_135m, build_tiny_llama, build_tiny_tools

BUILTIN_PREFIX = "builtin:"
CACHE_DIR_ENV = "KVGATE_CACHE_DIR"


class ModelSourceError(ValueError):
    """A model source that cannot be resolved: an unknown builtin, a missing directory, a failed
    download or conversion, or a scheme not supported yet. The message says which and why."""


# builtin name -> (directory name in <cache>/models, builder(out_dir, cache_dir))
_BUILTINS: MappingProxyType[str, tuple[str, Callable[[Path, Path], None]]] = MappingProxyType({
    "tiny-llama": ("tiny-llama-v1", build_tiny_llama),
    "tiny-tools": ("tiny-tools-v1", build_tiny_tools),
    "smollm2-135m": ("smollm2-135m-v1", build_smollm2_135m),
})


def builtin_names() -> tuple[str, ...]:
    return tuple(_BUILTINS)


def default_cache_dir() -> Path:
    """$KVGATE_CACHE_DIR, else ~/.cache/kvgate."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvgate"


def resolve_model_source(source: str, cache_dir: Path | None = None, s3_endpoint_url: str | None = None) -> Path:
    """The local Hugging Face model directory for `source`; builds a builtin, or fetches an s3:// model, on first
    use. `s3_endpoint_url`: None reads $KVGATE_S3_ENDPOINT_URL, then $AWS_ENDPOINT_URL, else AWS itself.

    Idempotent and safe to call from concurrent processes. Raises ModelSourceError.
    """
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX):]
        if name not in _BUILTINS:
            raise ModelSourceError(f"unknown builtin model {source!r}; known: "
                                   + ", ".join(BUILTIN_PREFIX + n for n in _BUILTINS))
        dir_name, builder = _BUILTINS[name]
        return _materialize(dir_name, builder, Path(cache_dir) if cache_dir else default_cache_dir())
    if source.startswith("s3://"):
        from kvgate.engine.lora.source import s3_endpoint_url as endpoint_from_env
        from kvgate.engine.s3_models import fetch_s3_model

        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        return fetch_s3_model(source, cache, endpoint_from_env(s3_endpoint_url)).path
    if "://" in source:
        raise ModelSourceError(f"{source}: unsupported scheme; use a local directory, s3:// or builtin:<name>")
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ModelSourceError(f"{source}: no such model directory")
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{source}: not a Hugging Face model directory (no config.json)")
    return path


def _materialize(dir_name: str, builder: Callable[[Path, Path], None], cache_dir: Path) -> Path:
    models = cache_dir / "models"
    target = models / dir_name
    if target.is_dir():  # fast path: renamed into place only when complete
        return target
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{dir_name}.lock"):
        if target.is_dir():  # another process built it while we waited for the lock
            return target
        for stale in models.glob(f".{dir_name}.tmp-*"):  # left by a build that crashed
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{dir_name}.tmp-", dir=models))
        try:
            builder(work, cache_dir)
            work.chmod(0o755)  # mkdtemp made it private; a cache may be shared by several users
            os.rename(work, target)
        except ModelSourceError:
            raise
        except Exception as exc:
            raise ModelSourceError(f"building builtin model {dir_name} in {cache_dir} failed: {exc}") from exc
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock held for the block; the kernel drops it if the process dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
