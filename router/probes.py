"""The HTTP probes of one replica: GET /health every health interval, GET /metrics every poll interval.

Each probe is a loop that only awaits I/O and hands what it found to a synchronous callback
(`ReplicaTracker` applies it, decides with `router.health`), so no await happens half-way through a
change. A probe never outlives its interval (`HttpTarget.timeout_s`): a stalled replica is marked, not
waited on. The gRPC state stream of a kvgate engine is the other reader (`load_readers.watch_stream`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvgate.clock import Clock
from kvgate.router.load_readers import LoadReport, parse_metrics, replica_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpTarget:
    """How to reach one replica's HTTP endpoints; the callables are asked on every probe, so a reload's new
    API key and the tracker's session are the ones used."""

    url: str  # the replica's base URL
    session: Callable[[], aiohttp.ClientSession]  # raises RuntimeError before the tracker started
    headers: Callable[[], dict[str, str] | None]  # its Authorization, if it asks for one
    timeout_s: float


async def health_loop(target: HttpTarget, clock: Clock, interval_s: float, on_result: Callable[[bool], None]) -> None:
    """Check /health now and every `interval_s`: a 200 passes; any other status or an error fails."""
    while True:
        try:
            async with target.session().get(replica_url(target.url, "/health"), headers=target.headers(),
                                             timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:
                ok = response.status == 200
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("health check %s failed: %r", target.url, exc)
            ok = False
        on_result(ok)
        await clock.sleep(interval_s)


async def scrape_loop(target: HttpTarget, clock: Clock, interval_s: float, on_load: Callable[[LoadReport], None]) -> None:
    """Read /metrics now and every `interval_s`; a failed scrape keeps the last load (health is the health
    check's to decide)."""
    while True:
        try:
            async with target.session().get(replica_url(target.url, "/metrics"), headers=target.headers(),
                                             timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:
                text = await response.text() if response.status == 200 else None
            if text is not None:
                on_load(parse_metrics(text))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("scrape %s/metrics failed: %r", target.url, exc)
        await clock.sleep(interval_s)
