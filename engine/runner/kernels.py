"""Compiled CPU kernels (csrc/): built once per machine with torch's C++ extension tooling, kept in a cache keyed
by their content, and loaded in milliseconds on every later start.

Today there is one, `paged_attention` (csrc/paged_attention.cpp): decode attention that reads the paged KV
cache in place instead of gathering each sequence's blocks into a workspace first.

Building needs a C++ compiler and ninja, and takes about 20 s on two cores, so an engine never waits for it
unless asked (`attention_kernel="wait"`): with "auto" it loads a cached build at once, or builds one on a
background thread and gathers until the build lands. A machine without a compiler keeps gathering, after one
log line that says why. Images build the kernel ahead (`python -m kvgate.engine.runner.kernels`, see the
Dockerfile), so their replicas have it from the first step.

Cache: $KVGATE_KERNEL_DIR, else $KVGATE_CACHE_DIR/kernels, else ~/.cache/kvgate/kernels. A build is named by
a hash of the source, the torch version and the instruction set it was compiled for, so a new kvgate, a new
torch or a machine without AVX-512 never loads a build that does not fit it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import torch

from kvgate.engine.builtin import CACHE_DIR_ENV

log = logging.getLogger("kvgate.engine.kernels")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
MODES = ("auto", "wait", "off")

# torch's CPU capability -> instruction sets to compile for. Never -march=native: an image built on one
# host runs on others; the capability is part of the cache key instead.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
# -ffast-math lets the compiler vectorise exp and reassociate sums; the kernel avoids infinities for it.
BASE_FLAGS = ["-O3", "-fopenmp", "-ffast-math"]
BUILD_TIMEOUT_S = 600.0


def cache_dir(env: Mapping[str, str]) -> Path:
    if env.get("KVGATE_KERNEL_DIR"):
        return Path(env["KVGATE_KERNEL_DIR"]).expanduser()
    root = Path(env[CACHE_DIR_ENV]).expanduser() if env.get(CACHE_DIR_ENV) else Path.home() / ".cache" / "kvgate"
    return root / "kernels"


def build_name(source: bytes, torch_version: str, capability: str) -> str:
    """The module's name: what was compiled, against which torch, for which instruction set."""
    digest = hashlib.sha256(b"\0".join([source, torch_version.encode(), capability.encode(),
                                        " ".join(BASE_FLAGS).encode()])).hexdigest()
    return f"kvgate_paged_attention_{digest[:16]}"


@functools.cache
def kernel_name(capability: str) -> str:
    """This source's build name for `capability` (the file is read and hashed once per process)."""
    return build_name(SOURCE.read_bytes(), torch.__version__, capability)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_cached(root: Path, name: str) -> ModuleType | None:
    """The cached build, or None when there is none. Raises UntrustedCache for a file this user does not own or
    others may write (loading it would run their code), ImportError or OSError for one that does not load."""
    path = root / f"{name}.so"
    if not path.is_file():
        return None
    for item in (root, path):  # this user's, or root's (an image's, built into it), and no one else may write it
        info = item.stat()
        if info.st_uid not in (os.getuid(), 0) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedCache(f"{item} belongs to uid {info.st_uid} or is writable by others; not loading it")
    return _import(name, path)


class UntrustedCache(OSError):
    """A cached kernel that another user could have written."""


# Run in a child process of its own session: torch's builder keeps per-process state (a second build of one name
# in one process is renamed name_v1), a compiler's memory never lands in the engine's, and a timeout ends the
# whole build (ninja and the compilers too).
_BUILD = """
import json, sys
from torch.utils.cpp_extension import load
name, source, work, cflags = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
load(name=name, sources=[source], build_directory=work, extra_cflags=cflags, extra_ldflags=["-fopenmp"])
"""


def build(root: Path, name: str, capability: str, load: bool = True) -> ModuleType | None:
    """Compile in a private folder, in a child process, under a lock file (replicas starting together on a fresh
    machine build once; the others wait and load that build), then move the library into place with one rename,
    so that no process loads half a file. Raises RuntimeError (with the compiler's last words) or OSError."""
    compiler = os.environ.get("CXX", "c++")  # what torch's builder runs
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) on PATH; install g++ (Debian: build-essential)")
    env = dict(os.environ)
    if shutil.which("ninja") is None:
        # kvgate[engine] brings pip's ninja into the interpreter's bin folder, which is not on PATH when a
        # venv's python runs without the venv activated; torch's builder looks for ninja on PATH.
        bin_dir = str(Path(sys.executable).parent)
        if shutil.which("ninja", path=bin_dir) is None:
            raise RuntimeError("ninja not found: pip install ninja (kvgate[engine] brings it)")
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    with open(root / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / f"{name}.so").is_file():  # built by another process while this one waited
            return load_cached(root, name) if load else None
        for stale in root.glob(f"build-{name}-*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"build-{name}-", dir=root))
        try:
            _compile(name, work, capability, env)
            os.replace(work / f"{name}.so", root / f"{name}.so")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _import(name, root / f"{name}.so") if load else None


def _compile(name: str, work: Path, capability: str, env: dict[str, str]) -> None:
    flags = json.dumps(BASE_FLAGS + ISA_FLAGS.get(capability, []))
    child = subprocess.Popen([sys.executable, "-c", _BUILD, name, str(SOURCE), str(work), flags], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = child.communicate(timeout=BUILD_TIMEOUT_S)
    except BaseException:  # a timeout, or this process stopping: end the build's whole process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise
    if child.returncode != 0:
        said = output.strip().splitlines()
        raise RuntimeError("the compiler failed: " + " | ".join(said[-5:]))


class KernelLoader:
    """Makes the compiled kernel available to the model runner. `paged_attention` is the kernel's function,
    or None while it is being built, when it cannot be built, off the CPU, or with mode "off"."""

    def __init__(self, mode: str, device: torch.device, env: Mapping[str, str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"attention_kernel must be one of {', '.join(MODES)}; got {mode!r}")
        self.paged_attention = None
        self.status = "off"  # off | ready | building | unavailable: <why>
        if mode == "off" or device.type != "cpu":
            return
        env = os.environ if env is None else env
        self.root = cache_dir(env)
        self.capability = torch.backends.cpu.get_cpu_capability()
        self.name = kernel_name(self.capability)
        try:
            module = load_cached(self.root, self.name)
        except (ImportError, OSError) as exc:  # a cached build that does not load: build a fresh one
            log.warning("the cached paged-attention kernel does not load (%s); building it again", exc)
            with contextlib.suppress(OSError):
                (self.root / f"{self.name}.so").unlink()
            module = None
        if module is not None:
            self._ready(module)
        elif mode == "wait":
            self._build()
        else:
            self.status = "building"
            threading.Thread(target=self._build, name="kvgate-kernel-build", daemon=True).start()

    def _ready(self, module: ModuleType) -> None:
        self.paged_attention = module.paged_attention
        self.status = "ready"

    def _build(self) -> None:
        log.info("building the paged-attention kernel for %s into %s (once per machine; decodes gather their "
                 "KV blocks until it is ready)", self.capability, self.root)
        started = time.perf_counter()
        try:
            module = build(self.root, self.name, self.capability)
        except Exception as exc:  # a missing compiler, a full disk: the engine runs on without the kernel
            detail = str(exc).strip().splitlines()
            self.status = f"unavailable: {detail[-1] if detail else type(exc).__name__}"
            log.warning("paged-attention kernel not built (%s); decodes keep gathering their KV blocks, which is "
                        "slower. Set attention_kernel to 'off' to skip the attempt.", self.status)
            return
        self._ready(module)
        log.info("paged-attention kernel ready in %.1f s", time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    """Build the kernel into the cache now (for images and `make setup`), and say where it is."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvgate.engine.runner.kernels",
                                     description="Build the engine's CPU attention kernel into the kernel cache "
                                     "($KVGATE_KERNEL_DIR, else $KVGATE_CACHE_DIR/kernels, else ~/.cache/kvgate/kernels).")
    parser.add_argument("--isa", nargs="+", choices=sorted(ISA_FLAGS), metavar="ISA",
                        help=f"build for these instruction sets too ({', '.join(sorted(ISA_FLAGS))}), as an image "
                        "does for the hosts it may run on (default: this machine's only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loader = KernelLoader("wait", torch.device("cpu"))
    if loader.paged_attention is None:
        print(f"kvgate: the paged-attention kernel is {loader.status}", file=sys.stderr)
        return 1
    print(f"paged-attention kernel for {loader.capability}: {loader.root / loader.name}.so")
    for isa in args.isa or ():
        if isa == loader.capability:
            continue
        name = kernel_name(isa)
        try:
            build(loader.root, name, isa, load=False)  # never loaded here: this CPU may lack the instructions
        except (RuntimeError, OSError) as exc:
            print(f"kvgate: the paged-attention kernel for {isa} was not built: {exc}", file=sys.stderr)
            return 1
        print(f"paged-attention kernel for {isa}: {loader.root / name}.so")
    return 0


if __name__ == "__main__":
    sys.exit(main())
