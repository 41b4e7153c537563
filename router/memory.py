"""`/admin/memory`: the gateway's resident memory and, while `tracemalloc` traces, where its Python allocations are.

Tracing is Python's own: start the gateway with `PYTHONTRACEMALLOC=1` (or N frames) to trace from the first
allocation. It costs CPU (the soak's gateway used 2.1x its untraced CPU) and memory (tracemalloc's tables, reported
as `tracemalloc_overhead_bytes`: ~23 MiB for ~250,000 live blocks), so it is for a soak or a hunt, not every day.
Without it the endpoint still answers, with `tracing: false` and the RSS.

- `GET /admin/memory?top=N`: RSS (`/proc/self/status` VmRSS), traced current/peak bytes, tracemalloc's overhead,
  and the N largest allocation sites grouped by file:line (default 25, at most MAX_TOP); with a baseline set,
  also the N sites whose live bytes grew most since it (`growth`): set the baseline after warm-up, look again an
  hour later. `top=0`: the figures alone, no look at the sites (cheap: poll it).
- `POST /admin/memory/baseline`: keep the per-site totals now as the baseline (a new POST replaces it).
- Always, tracing or not: the cyclic garbage collector's figures (`gc`: collections per generation, objects
  waiting in each). With sites: `garbage`, what a full collection would free now (bytes, objects, the most
  common types), measured in the copy below by running one there; the sites are what stays reachable after it.
  Garbage (objects in reference cycles) waits for the cyclic collector, which the gateway runs rarely
  (`router.main.GC_GEN0_THRESHOLD`: once 50,000 more objects were made than freed, which a gateway in a steady
  state may not reach for hours), so growth that shows here as garbage is such a wait, and growth in the sites is
  what a leak looks like.

Looking at the sites means a tracemalloc snapshot, which copies every trace into Python objects: ~5 s of CPU and
~70 MiB at ~250,000 live blocks, which the process would then keep as freed-but-resident memory and as a bigger
trace table, so each look would step the very RSS curve it explains. The look is therefore taken in a forked copy
of the gateway (`run_forked`), which sends back only its answer; the gateway's memory and event loop do not see
it. The baseline is kept as that copy sent it, zlib-compressed JSON (~0.12 MiB for ~25,000 sites), read again
only by the next look's copy.

Both sit under `/admin/`, behind the admin token when one is set (`router.operator_access`). The formatting is
pure (`group_sites`, `growth`, `memory_report`); `MemoryProbe` and `run_forked` are the I/O.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import select
import signal
import tracemalloc
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web

from kvgate.clock import Clock
from kvgate.openai_wire import ApiError, bad_request

DEFAULT_TOP = 25
MAX_TOP = 500  # sites per answer: past a few hundred the tail is noise, and each costs ~100 bytes of JSON
MIB = 1 << 20
LOOK_TIMEOUT_S = 60.0  # a forked look still running after this is killed, and the request gets a 503

Sites = Mapping[str, tuple[int, int]]  # "file:line" -> (live bytes, live blocks)


@dataclass(frozen=True)
class Traced:
    """tracemalloc's figures: what Python holds now, the most it held, and what tracing itself costs (its
    tables, outside the traced figures but inside the RSS)."""

    current_bytes: int
    peak_bytes: int
    overhead_bytes: int


@dataclass(frozen=True)
class Baseline:
    at_s: float  # the clock's now() when it was taken
    num_sites: int
    sites_zjson: bytes = b""  # zlib-compressed JSON of the Sites (`encode_sites`)


def vm_rss_bytes(proc_status: str) -> int | None:
    """The VmRSS line of a /proc/PID/status text in bytes ("VmRSS:   80124 kB" -> 82,046,976); None if absent."""
    for line in proc_status.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) >= 2 and fields[1].isdigit() else None
    return None


def top_param(value: str | None) -> int:
    """`?top=`: DEFAULT_TOP when absent, capped at MAX_TOP; 0 asks for no sites. Raises ApiError 400 unless a
    whole number."""
    if value is None:
        return DEFAULT_TOP
    if not value.isdigit():
        raise bad_request(f"'top' must be a whole number, 0 to {MAX_TOP} (0: no sites, no snapshot)", "top")
    return min(int(value), MAX_TOP)


def short_path(filename: str) -> str:
    """A site's file as it reads best in a table: from the package on for an installed one
    (".../site-packages/aiohttp/web.py" -> "aiohttp/web.py"), from the standard library's root for Python's own
    (".../lib/python3.12/asyncio/events.py" -> "asyncio/events.py"), else as traced."""
    cut = filename.rfind("/site-packages/")
    if cut >= 0:
        return filename[cut + len("/site-packages/"):]
    cut = filename.rfind("/lib/python3.")
    slash = filename.find("/", cut + len("/lib/python3.")) if cut >= 0 else -1
    return filename[slash + 1:] if slash >= 0 else filename


def group_sites(statistics: Iterable[tracemalloc.Statistic]) -> dict[str, tuple[int, int]]:
    """Per "file:line" (bytes, blocks) of `Snapshot.statistics("lineno")`: one frame each."""
    sites: dict[str, tuple[int, int]] = {}
    for stat in statistics:
        frame = stat.traceback[0]
        key = f"{short_path(frame.filename)}:{frame.lineno}"
        size, count = sites.get(key, (0, 0))
        sites[key] = (size + stat.size, count + stat.count)
    return sites


def encode_sites(sites: Sites) -> bytes:
    return zlib.compress(json.dumps(sites, separators=(",", ":")).encode())


def decode_sites(data: bytes) -> dict[str, tuple[int, int]]:
    return {site: (size, count) for site, (size, count) in json.loads(zlib.decompress(data)).items()}


def largest(sites: Sites, top: int) -> list[dict[str, object]]:
    """The `top` sites holding the most live bytes, largest first."""
    ranked = sorted(sites.items(), key=lambda item: (-item[1][0], item[0]))[:top]
    return [{"site": site, "size_bytes": size, "num_blocks": count} for site, (size, count) in ranked]


def growth(baseline: Sites, now: Sites, top: int) -> list[dict[str, object]]:
    """The `top` sites whose live bytes grew most from `baseline` to `now` (a site gone counts as shrunk to 0),
    largest growth first; sites that did not grow are left out."""
    diffs = [(now.get(site, (0, 0))[0] - baseline.get(site, (0, 0))[0], site) for site in set(baseline) | set(now)]
    diffs = sorted((d for d in diffs if d[0] > 0), key=lambda d: (-d[0], d[1]))[:top]
    return [{"site": site, "size_diff_bytes": diff, "size_bytes": now[site][0],
             "num_blocks_diff": now[site][1] - baseline.get(site, (0, 0))[1]} for diff, site in diffs]


def sites_report(sites: Sites, top: int, baseline: Sites | None) -> dict[str, object]:
    """The sites' part of GET /admin/memory: how many, the largest, and the growth since the baseline."""
    report: dict[str, object] = {"num_sites": len(sites), "top": largest(sites, top)}
    if baseline is not None:
        report["growth"] = growth(baseline, sites, top)
    return report


def gc_figures(stats: list[dict[str, int]], pending: tuple[int, ...]) -> dict[str, object]:
    """`gc.get_stats()` and `gc.get_count()` per generation (youngest first), as lists."""
    return {"collections": [g["collections"] for g in stats], "collected": [g["collected"] for g in stats],
            "uncollectable": [g["uncollectable"] for g in stats], "pending": list(pending)}


def memory_report(rss_bytes: int | None, traced: Traced | None, sites: Mapping[str, object] | None,
                  baseline: Baseline | None, now_s: float, gc_now: Mapping[str, object] | None = None
                  ) -> dict[str, object]:
    """The body of GET /admin/memory: `tracing: false`, the RSS and the gc figures alone when tracemalloc is off;
    `sites` is the look's answer (`sites_report` and `garbage`), None when not asked for."""
    report: dict[str, object] = {"rss_bytes": rss_bytes, "rss_mib": None if rss_bytes is None else rss_bytes / MIB,
                                 "tracing": traced is not None}
    if gc_now is not None:
        report["gc"] = dict(gc_now)
    if traced is None:
        return report
    report.update({"traced_current_bytes": traced.current_bytes, "traced_peak_bytes": traced.peak_bytes,
                   "tracemalloc_overhead_bytes": traced.overhead_bytes})
    if sites is not None:
        report.update(sites)
        if baseline is not None:
            report["baseline_age_s"] = now_s - baseline.at_s
    return report


# ------------------------------------------------------------------------------------------- the shell


class LookFailed(Exception):
    pass


def run_forked(compute: Callable[[], bytes], timeout_s: float = LOOK_TIMEOUT_S) -> bytes:
    """`compute()` run in a forked copy of this process, its bytes sent back through a pipe; blocking (call it on
    a worker thread). Whatever the copy allocates stays in the copy. Raises LookFailed when the copy fails,
    dies or is still running after `timeout_s` (then it is killed). On Python 3.12+ a fork of a process with
    threads warns (DeprecationWarning) that the copy may deadlock on a lock another thread held: the copy takes
    none that the gateway's threads hold for long, and the timeout ends it if it ever did."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: compute, write, leave at once (no atexit, no cleanup of the parent's resources)
        status = 1
        try:
            _leave_fds_and_signals_to_the_parent(write_fd)
            data = memoryview(compute())
            while data:
                data = data[os.write(write_fd, data):]
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    data = None
    try:
        data = _read_until_eof(read_fd, timeout_s)
    finally:
        os.close(read_fd)
        if data is None:  # timed out (or the read failed): the copy may be running still
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)  # after EOF the copy is exiting: this returns at once
    if data is None:
        raise LookFailed(f"the look did not finish within {timeout_s:g} s")
    if status != 0:
        raise LookFailed(f"the forked look ended with status {status}")
    return data


def _leave_fds_and_signals_to_the_parent(keep_fd: int) -> None:
    """In the copy: stdio on /dev/null, every other descriptor but `keep_fd` closed, so that a connection the gateway closes
    meanwhile ends at once (a socket ends when its last descriptor closes), and a SIGINT or SIGTERM sent to the
    process group ends the copy at once, never reaching the parent's event loop through the wakeup pipe the two
    shared (where it would count as a second signal to the gateway)."""
    signal.set_wakeup_fd(-1)
    devnull = os.open(os.devnull, os.O_RDWR)  # the copy says nothing (a finalizer its collection runs might)
    for stdio in (0, 1, 2):
        os.dup2(devnull, stdio)
    os.close(devnull)
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, os.sysconf("SC_OPEN_MAX"))
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _read_until_eof(fd: int, timeout_s: float) -> bytes | None:
    """All `fd` gives until EOF; None when `timeout_s` passes with nothing to read. (poll, not select: a busy
    gateway's descriptors run past select's 1,024.)"""
    chunks: list[bytes] = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if not poller.poll(timeout_s * 1000):
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _collect_garbage(top: int) -> dict[str, object]:
    """In the copy: one full collection, and what its garbage held (bytes traced with it kept less after it is
    freed, so the interpreter's free lists, which a full collection also empties, do not count), how many
    objects and of which types (the `top` most common); and `free_lists_bytes`, what the emptied free lists held
    (freed objects the interpreter keeps for reuse, up to a fixed number per kind: 2,000 tuples per size...)."""
    before = tracemalloc.get_traced_memory()[0]
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds in gc.garbage, to count it by type
    try:
        num_objects = gc.collect()
    finally:
        gc.set_debug(0)
    held = tracemalloc.get_traced_memory()[0]
    by_type = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    types = [{"type": name, "num_objects": count} for name, count in by_type.most_common(top)]
    del by_type
    gc.garbage.clear()
    gc.collect()  # now freed
    freed = held - tracemalloc.get_traced_memory()[0]  # less the few KB of `types`: < 0 when there was none
    return {"bytes": max(freed, 0), "num_objects": num_objects, "types": types, "free_lists_bytes": before - held}


def _look_at_sites(top: int, baseline: Baseline | None) -> bytes:
    """In the copy: the garbage a full collection frees, then the sites of what stays reachable (the growth
    of a leak, without the garbage that only waits for a collection), then the baseline decoded."""
    garbage = _collect_garbage(top)
    sites = _snapshot_sites()
    prior = decode_sites(baseline.sites_zjson) if baseline is not None else None
    return json.dumps({**sites_report(sites, top, prior), "garbage": garbage}).encode()


def _look_for_baseline() -> bytes:
    """In the copy: the number of sites, a newline, and the encoded sites of what stays reachable after a full
    collection; the gateway keeps the bytes and never decodes them."""
    gc.collect()
    sites = _snapshot_sites()
    return b"%d\n" % len(sites) + encode_sites(sites)


def _snapshot_sites() -> dict[str, tuple[int, int]]:
    # Leave out what a look itself allocates: tracemalloc's own frames while it builds the snapshot.
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    return group_sites(snapshot.statistics("lineno"))


class MemoryProbe:
    """Reads the process's memory; holds the baseline. One per app (`MEMORY_KEY`)."""

    def __init__(self, clock: Clock, proc_status_path: str = "/proc/self/status") -> None:
        self._clock = clock
        self._proc_status_path = proc_status_path
        self.baseline: Baseline | None = None
        self._one_look = asyncio.Lock()  # one forked copy at a time, however many operators ask

    async def _look(self, compute: Callable[[], bytes]) -> bytes:
        async with self._one_look:
            return await _look(compute)

    def rss_bytes(self) -> int | None:
        try:
            with open(self._proc_status_path) as status:
                return vm_rss_bytes(status.read())
        except OSError:  # not Linux
            return None

    async def report(self, top: int) -> dict[str, object]:
        """GET /admin/memory's body. Raises ApiError 503 when the look at the sites fails."""
        gc_now = gc_figures(gc.get_stats(), gc.get_count())
        if not tracemalloc.is_tracing():
            return memory_report(self.rss_bytes(), None, None, None, self._clock.now(), gc_now)
        current, peak = tracemalloc.get_traced_memory()
        traced = Traced(current, peak, tracemalloc.get_tracemalloc_memory())
        baseline = self.baseline
        sites = json.loads(await self._look(lambda: _look_at_sites(top, baseline))) if top > 0 else None
        return memory_report(self.rss_bytes(), traced, sites, baseline, self._clock.now(), gc_now)

    async def set_baseline(self) -> Baseline | None:
        """Keep the sites now as the baseline; None (and nothing kept) when tracemalloc is not tracing."""
        if not tracemalloc.is_tracing():
            self.baseline = None
            return None
        num_sites, _, sites_zjson = (await self._look(_look_for_baseline)).partition(b"\n")
        self.baseline = Baseline(self._clock.now(), int(num_sites), sites_zjson)
        return self.baseline


async def _look(compute: Callable[[], bytes]) -> bytes:
    try:
        return await asyncio.to_thread(run_forked, compute)
    except (LookFailed, OSError) as exc:
        raise ApiError(503, f"the look at the gateway's allocations failed: {exc}", type="ServiceUnavailableError",
                       code="memory_look_failed") from exc


MEMORY_KEY = web.AppKey("kvgate_memory_probe", MemoryProbe)


async def admin_memory(request: web.Request) -> web.Response:
    """RSS, traced figures, the largest sites and, with a baseline, the growth since it (module docstring)."""
    return web.json_response(await request.app[MEMORY_KEY].report(top_param(request.query.get("top"))))


async def admin_memory_baseline(request: web.Request) -> web.Response:
    """Keep the per-site totals now as the baseline `growth` is measured from; tracing off: nothing kept."""
    probe = request.app[MEMORY_KEY]
    baseline = await probe.set_baseline()
    return web.json_response({"tracing": baseline is not None, "rss_bytes": probe.rss_bytes(),
                              "num_sites": baseline.num_sites if baseline is not None else 0})


def install_memory_routes(app: web.Application, clock: Clock) -> None:
    """GET /admin/memory and POST /admin/memory/baseline, with the probe they share."""
    app[MEMORY_KEY] = MemoryProbe(clock)
    app.router.add_get("/admin/memory", admin_memory)
    app.router.add_post("/admin/memory/baseline", admin_memory_baseline)
