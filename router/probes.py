"""The HTTP probes of one replica: GET /health every health interval, GET /metrics every poll interval.

Each probe is a loop that only awaits I/O and hands what it found to a synchronous callback
(`ReplicaTracker` applies it, decides with `router.health`), so no await happens half-way through a
change. A probe never outlives its interval (`HttpTarget.timeout_s`): a stalled replica is marked, not
waited on. The gRPC state stream of a kvgate engine is the other reader (`load_readers.watch_stream`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import aiohttp

from kvgate.clock import Clock, sleep_or_wake
from kvgate.log_limit import LogLimiter
from kvgate.router.load_readers import LoadReport, parse_metrics, replica_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpTarget:
    """How to reach one replica's HTTP endpoints; the callables are asked on every probe, so a reload's new
    API key and the tracker's session are the ones used."""

    url: str  # the replica's base URL: never logged, it may hold credentials
    session: Callable[[], aiohttp.ClientSession]  # raises RuntimeError before the tracker started
    headers: Callable[[], dict[str, str] | None]  # its Authorization, if it asks for one
    timeout_s: float
    name: str  # the replica's public id, for log lines


class ProbeLog:
    """What one probe loop logs: the first failure of each kind (an error class, a status), then a line a
    minute with the count while it lasts, and one line when the replica answers 200 again; a replica that
    is down or booting is probed every few seconds for as long as it is tracked."""

    def __init__(self, what: str, replica: str) -> None:
        self._what, self._replica = what, replica  # "health check", the replica's public id
        self._failures = LogLimiter()

    def answered(self, status: int, now: float) -> None:
        if status != 200:
            self.failed(status, f"HTTP {status}", now)
        elif (ended := self._failures.clear_all(now)) is not None:
            log.info("%s of replica %s passes again after %.1f s and %d failure(s)", self._what, self._replica,
                     ended.duration_s, ended.num_events)

    def failed(self, kind: Hashable, why: str, now: float) -> None:
        if (verdict := self._failures.hit(kind, now)) is not None:
            log.info("%s of replica %s failed: %s%s", self._what, self._replica, why, verdict.note)


async def health_loop(target: HttpTarget, clock: Clock, interval_s: float, on_result: Callable[[bool], None],
                      on_unanswered: Callable[[], None] | None = None, check_now: asyncio.Event | None = None) -> None:
    """Check /health now and every `interval_s`, or at once when `check_now` is set: a 200 passes
    (`on_result(True)`); any other status fails (`on_result(False)`), and so does no answer in `target.timeout_s`
    (a timeout, a refused or reset connection), which goes to `on_unanswered` instead where one is given."""
    check_now = check_now or asyncio.Event()
    said = ProbeLog("health check", target.name)
    while True:
        answered = True
        try:
            async with target.session().get(replica_url(target.url, "/health"), headers=target.headers(),
                                             timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:
                ok = response.status == 200
            said.answered(response.status, clock.now())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            said.failed(type(exc).__name__, _why(exc), clock.now())
            ok = answered = False
        if answered or on_unanswered is None:
            on_result(ok)
        else:
            on_unanswered()
        await sleep_or_wake(clock, interval_s, check_now)
        check_now.clear()


async def scrape_loop(target: HttpTarget, clock: Clock, interval_s: float, on_load: Callable[[LoadReport], None]) -> None:
    """Read /metrics now and every `interval_s`; a failed scrape keeps the last load (health is the health
    check's to decide)."""
    said = ProbeLog("/metrics scrape", target.name)
    while True:
        try:
            async with target.session().get(replica_url(target.url, "/metrics"), headers=target.headers(),
                                             timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:
                text = await response.text() if response.status == 200 else None
            said.answered(response.status, clock.now())
            if text is not None:
                on_load(parse_metrics(text))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            said.failed(type(exc).__name__, _why(exc), clock.now())
        await clock.sleep(interval_s)


def _why(exc: Exception) -> str:
    """A failed probe's error for the log: its repr, but only the class of aiohttp's InvalidURL, which holds
    the URL, credentials and all."""
    return type(exc).__name__ if isinstance(exc, aiohttp.InvalidURL) else repr(exc)
