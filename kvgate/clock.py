"""The one place kvgate reads time.

Everything that needs the time takes a `Clock`. Production code gets a `RealClock`; tests and the
simulator get a `FakeClock` and move time forward by hand, so ten minutes of traffic play in a
millisecond and every timing-dependent test is deterministic.

Both clocks give seconds as floats on one monotonic timeline (`now()`), plus the wall-clock time
(`wall()`) for things that are shown to people or written into records that outlive the process.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """A source of time and a way to wait for it."""

    def now(self) -> float:
        """Seconds on a monotonic timeline; only differences are meaningful."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for display and for records shared between processes."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait until `now()` has advanced by `seconds` (at once for 0 or less)."""
        ...


class RealClock:
    """The machine's clocks: `time.monotonic`, `time.time` and `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told to.

    `sleep` parks the caller until `advance` (or `set`) moves time past its deadline. Sleepers wake
    in deadline order, and `advance` yields to the event loop after each wake-up so that a woken task
    runs (and may sleep again) before time moves further: a loop that polls every second, driven by
    `await clock.advance(600)`, runs exactly 600 times.
    """

    def __init__(self, start: float = 1_000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall_offset + self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        await future

    @property
    def num_sleepers(self) -> int:
        """Tasks currently parked in `sleep` (cancelled ones excluded)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, waking every sleeper whose deadline is passed, in order."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        await self.set(self._now + seconds)

    async def set(self, target: float) -> None:
        """Move time forward to `target`, waking sleepers in deadline order on the way."""
        if target < self._now:
            raise ValueError(f"a clock cannot go back: set({target}) while now is {self._now}")
        await _let_tasks_run()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, future = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not future.done():
                future.set_result(None)
                await _let_tasks_run()
        self._now = target
        await _let_tasks_run()


async def _let_tasks_run(rounds: int = 5) -> None:
    # A woken task may need several loop iterations (await chains, queue hand-offs) to reach its next
    # sleep; a handful of zero-sleeps covers the chains kvgate's loops use without real waiting.
    for _ in range(rounds):
        await asyncio.sleep(0)


async def sleep_or_wake(clock: Clock, seconds: float, wake: asyncio.Event) -> None:
    """Sleep `seconds` on `clock`, or less: return as soon as `wake` is set (at once when it already is). For
    loops that also act on a signal (a request waiting at zero replicas, a replica turning ready)."""
    if wake.is_set():
        return
    sleeping = asyncio.ensure_future(clock.sleep(seconds))
    woken = asyncio.ensure_future(wake.wait())
    try:
        await asyncio.wait({sleeping, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeping.cancel()
        woken.cancel()
