"""Hot reload: watch a registry directory and hand each new valid snapshot to subscribers.

Polling, not inotify: it works the same on every filesystem, including Kubernetes ConfigMap volumes
(which swap a symlink) and network mounts. Each poll hashes the registry files' names and contents,
which for a registry of a few dozen small files costs well under a millisecond.

A change is loaded once it has settled (the same content on two polls in a row), so an editor or
`git checkout` caught halfway through a write is not reported as broken. A change that does not
validate keeps the last good snapshot in force; `last_error` says why, and the same broken content is
reported once, not every poll.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from kvgate.registry.loader import load_registry, registry_files
from kvgate.registry.problems import RegistryInvalid
from kvgate.registry.snapshot import Snapshot

log = logging.getLogger("kvgate.registry")

Subscriber = Callable[[Snapshot], None]


class Clock(Protocol):
    """What the watcher needs of a clock. `kvgate.clock` provides real and fake ones; the registry
    imports nothing of ours, so it names the shape instead of the class."""

    async def sleep(self, seconds: float) -> None: ...


def fingerprint(source: str | Path) -> str:
    """A hash of the registry's file names and contents; changes whenever any file does."""
    root = Path(source)
    digest = hashlib.sha256()
    try:
        files = registry_files(root) if root.exists() else []
        for path in files:
            digest.update(str(path.relative_to(root) if root.is_dir() else path.name).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    except OSError as exc:  # a file vanished between listing and reading: the next poll sees the end state
        digest.update(f"unreadable: {exc}".encode())
    return digest.hexdigest()


class RegistryWatcher:
    """Holds the current snapshot of a registry directory and reloads it when files change.

    Build it with `RegistryWatcher.open(...)`, which loads the first snapshot and raises
    `RegistryInvalid` if that fails (a gateway must not start on a broken registry). Then run
    `watch()` as a task, or call `poll()` from your own loop.
    """

    def __init__(self, source: str | Path, snapshot: Snapshot, initial_fingerprint: str, clock: Clock,
                 *, interval_s: float = 1.0, environ: Mapping[str, str] | None = None) -> None:
        self.source = str(source)
        self.clock = clock
        self.interval_s = interval_s
        self._environ = environ
        self._current = snapshot
        self._loaded_fingerprint = initial_fingerprint  # content that `current` (or last_error) came from
        self._pending_fingerprint: str | None = None  # changed content waiting to settle
        self._subscribers: list[Subscriber] = []
        self.last_error: RegistryInvalid | None = None
        self.num_reloads = 0

    @classmethod
    async def open(cls, source: str | Path, clock: Clock, *, interval_s: float = 1.0,
                   environ: Mapping[str, str] | None = None) -> RegistryWatcher:
        """Load the first snapshot; raises `RegistryInvalid` with every problem if it does not validate."""
        before = await asyncio.to_thread(fingerprint, source)
        snapshot = await asyncio.to_thread(load_registry, source, environ)
        return cls(source, snapshot, before, clock, interval_s=interval_s, environ=environ)

    @property
    def current(self) -> Snapshot:
        """The snapshot in force: the last one that validated."""
        return self._current

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(snapshot)` on every new snapshot (not for the current one). Returns an
        unsubscribe function. A callback that raises is logged and does not stop the others."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    async def poll(self) -> bool:
        """Look once for a change; returns True when a new snapshot was published."""
        now_fingerprint = await asyncio.to_thread(fingerprint, self.source)
        if now_fingerprint == self._loaded_fingerprint:
            self._pending_fingerprint = None
            return False
        if now_fingerprint != self._pending_fingerprint:
            self._pending_fingerprint = now_fingerprint  # changed: wait one poll for it to settle
            return False
        self._pending_fingerprint = None
        self._loaded_fingerprint = now_fingerprint
        try:
            snapshot = await asyncio.to_thread(load_registry, self.source, self._environ)
        except RegistryInvalid as exc:
            self.last_error = exc
            log.error("registry change rejected; keeping version %s. %s", self._current.version, exc)
            return False
        self.last_error = None
        if snapshot.version == self._current.version:
            return False  # files changed, meaning did not (comments, layout)
        previous, self._current = self._current, snapshot
        self.num_reloads += 1
        log.info("registry reloaded: version %s -> %s", previous.version, snapshot.version)
        for callback in list(self._subscribers):
            try:
                callback(snapshot)
            except Exception:  # one broken subscriber must not starve the rest
                log.exception("registry subscriber %r failed on version %s", callback, snapshot.version)
        return True

    async def watch(self) -> None:
        """Poll every `interval_s` until cancelled."""
        while True:
            await self.clock.sleep(self.interval_s)
            await self.poll()
