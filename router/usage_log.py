"""The usage log: an append-only JSON-lines file, one object per finished request (`router.usage.UsageRecord`),
written by a thread of its own so that the event loop never waits on the disk.

`append` only puts the record on a bounded queue; the writer thread takes what has queued, writes it as one
batch, flushes and fsyncs, so a line on disk survives the gateway's restart and the machine's (a crash loses at
most the batch being written). The file is opened in append mode and never truncated: a restarted gateway, or
several processes on one file, only add lines (each batch is one `write` of whole lines under O_APPEND).

Rotation: rename or move the file away (logrotate without `copytruncate`); before each batch the writer checks that
its path still names the file it has open, and opens a new one there when not. Nothing is lost across a rename:
a batch goes either to the old file or to the new.

When the disk stalls longer than the queue holds (MAX_QUEUED_RECORDS), new records are dropped, counted in
`num_dropped` (`kvgate_router_usage_records_dropped_total`), and said once a minute at most, rather than letting the
gateway's memory grow without bound.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

# ~300 bytes a record: ~20 MB at most, ~65 s of 1,000 requests/s with the disk stalled.
MAX_QUEUED_RECORDS = 65_536
_SAY_INTERVAL_S = 60.0
_STOP = object()


class UsageLog:
    """Appends JSON objects to `path`, one a line, from a daemon thread started at construction.
    `append` never blocks; `close` writes out what is queued and joins the thread (it blocks: call it off the
    event loop). Raises OSError at construction if the file cannot be opened, so a bad path stops the gateway's
    start rather than its billing."""

    def __init__(self, path: str | Path, now: Callable[[], float], on_dropped: Callable[[], None] = lambda: None,
                 max_queued: int = MAX_QUEUED_RECORDS) -> None:
        self.path = Path(path)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queued)
        try:
            self._file = self._open()
        except OSError as exc:
            raise OSError(f"cannot open the usage log {self.path}: {exc.strerror or exc}") from exc
        self._on_dropped = on_dropped
        self.num_dropped = 0  # records dropped while the queue was full
        self.num_written = 0
        # One line a minute at most per problem, on the thread that meets it, never one per record or batch.
        self._say_dropped, self._say_failed = _Throttled(now), _Throttled(now)
        self._thread = threading.Thread(target=self._run, name="kvgate-usage-log", daemon=True)
        self._thread.start()

    def append(self, record: dict[str, object]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1
            self._on_dropped()
            self._say_dropped("usage log %s: the writer is behind by %d records; dropped %d so far (disk stalled?)",
                              self.path, self._queue.maxsize, self.num_dropped)

    def close(self) -> None:
        """Write out every record appended before this call, then close the file. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._file.close()

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the log's life

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < 4096:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = _STOP in batch
            lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in batch if r is not _STOP)
            if lines:
                self._write(lines, len(batch) - stopping)

    def _write(self, lines: str, num_records: int) -> None:
        try:
            self._reopen_if_moved()
            self._file.write(lines)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.num_written += num_records
        except OSError as exc:  # a full or gone disk: say so, keep serving; the next batch tries again
            self._say_failed("usage log %s: could not write %d records: %s", self.path, num_records, exc)

    def _reopen_if_moved(self) -> None:
        """Open a new file at the path when the open one was renamed or removed (rotation)."""
        try:
            moved = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            moved = True
        if moved:
            self._file.close()
            self._file = self._open()


class _Throttled:
    """log.error, at most once per _SAY_INTERVAL_S (a full disk would otherwise say so for every batch)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._said_at: float | None = None

    def __call__(self, message: str, *args: object) -> None:
        now = self._now()
        if self._said_at is None or now - self._said_at >= _SAY_INTERVAL_S:
            self._said_at = now
            log.error(message, *args)
