"""`kvgate up`'s stop sequence on a fake clock: the parts stop in order, and the closing "stopped in" line
counts the whole stop, the gateway's drain included (it once counted the fleet release only, and said
"stopped in 1.2 s" after 11.2 s)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvgate.clock import FakeClock
from kvgate.stack import RunningStack, shut_down
from kvgate.state import MemoryStateStore


class FakeRunner:
    """The gateway: its cleanup waits for in-flight requests, here 10 s of them."""

    def __init__(self, clock: FakeClock, steps: list[str]) -> None:
        self._clock, self._steps = clock, steps

    async def cleanup(self) -> None:
        self._steps.append("gateway drained")
        await self._clock.advance(10.0)


class FakeAutoscaler:
    """An autoscaler whose fleet takes 1.2 s to release, on pools that list no stray replica."""

    def __init__(self, clock: FakeClock, steps: list[str]) -> None:
        self._clock, self._steps = clock, steps
        self.providers: dict[str, object] = {}

    async def stop(self) -> None:
        self._steps.append("autoscaler stopped")

    async def release_fleet(self) -> list[object]:
        self._steps.append("fleet released")
        await self._clock.advance(1.2)
        return []


async def test_the_stop_log_counts_from_the_start_of_the_stop_and_parts_stop_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    steps: list[str] = []
    store = MemoryStateStore(clock)
    watch = asyncio.create_task(asyncio.Event().wait())
    running = RunningStack(store, FakeRunner(clock, steps), watch, autoscaler=FakeAutoscaler(clock, steps))
    with caplog.at_level(logging.INFO, logger="kvgate.up"):
        await shut_down(running, clock)
    assert steps == ["autoscaler stopped", "gateway drained", "fleet released"]
    assert [r.getMessage() for r in caplog.records] == ["stopped in 11.2 s: every replica and node released"]
    assert watch.cancelled()
    with pytest.raises(Exception, match="closed"):
        await store.list_members()
