"""The wait at zero replicas (router/queueing.py): its depth, its bounds, and the first-waiter signal that makes
the gateway publish its observation at once (and, in `kvgate up`, wakes the autoscaler)."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.router.errors import ApiError
from kvgate.router.queueing import WaitQueues


async def test_only_the_first_request_waiting_at_a_model_is_signalled() -> None:
    ready = asyncio.Event()

    async def wait_for_replica(model: str, timeout_s: float) -> bool:
        await ready.wait()
        return True

    queues = WaitQueues(wait_for_replica)
    signalled: list[str] = []
    queues.on_first_waiter(signalled.append)

    waiters = [asyncio.create_task(queues.wait("m", max_queued=8, timeout_s=5)) for _ in range(3)]
    other = asyncio.create_task(queues.wait("n", max_queued=8, timeout_s=5))
    await asyncio.sleep(0)
    assert signalled == ["m", "n"] and queues.depths() == {"m": 3, "n": 1}

    ready.set()
    await asyncio.gather(*waiters, other)
    assert queues.depths() == {}
    again = asyncio.create_task(queues.wait("m", max_queued=8, timeout_s=5))  # the queue emptied: a new first
    await again
    assert signalled == ["m", "n", "m"]


async def test_a_full_queue_refuses_at_once_without_a_signal() -> None:
    async def never(model: str, timeout_s: float) -> bool:
        await asyncio.sleep(3600)
        return False

    queues = WaitQueues(never)
    signalled: list[str] = []
    queues.on_first_waiter(signalled.append)
    waiting = asyncio.create_task(queues.wait("m", max_queued=1, timeout_s=5))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as refused:
        await queues.wait("m", max_queued=1, timeout_s=5)
    assert refused.value.status == 503 and signalled == ["m"]
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert queues.depths() == {}


async def test_a_listener_that_raises_leaves_no_phantom_waiter() -> None:
    async def ready(model: str, timeout_s: float) -> bool:
        return True

    def broken(model: str) -> None:
        raise RuntimeError("a bug in a listener")

    queues = WaitQueues(ready)
    queues.on_first_waiter(broken)
    with pytest.raises(RuntimeError):
        await queues.wait("m", max_queued=8, timeout_s=5)
    assert queues.depths() == {}  # the autoscaler would otherwise see a queue forever
