"""A closed upstream connection (`router.upstream`) is freed by reference counting, not left for the cyclic garbage
collector, which the gateway runs rarely (`router.main.GC_GEN0_THRESHOLD`): in the gateway's memory soak such
connections, closed by the idle sweep, piled up for over an hour (docs/benchmarks.md). Real sockets, both loops."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from tests.router.test_upstream import (LONG_S, answering, json_answer, on_both_loops, pooled, post, post_and_read,
                                        serving)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_cyclic_collection() -> Iterator[None]:
    """Only reference counting frees anything during the test, as in the gateway between its rare collections."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def until_gone(ref: weakref.ref, what: str) -> None:
    for _ in range(100):  # the loop calls connection_lost soon after the close
        if ref() is None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} is still alive: only the cyclic collector would free it")


@on_both_loops
async def test_a_connection_the_idle_sweep_closes_is_freed_at_once() -> None:
    async with pooled(max_idle_s=0.1) as pool:
        async with serving(answering(json_answer(b"{}"))) as old, serving(answering(json_answer(b"{}"))) as other:
            await post_and_read(pool, old.url)
            [connection] = pool._live
            ref = weakref.ref(connection)
            del connection
            await asyncio.sleep(0.3)
            await post_and_read(pool, other.url)  # its release sweeps the idle one to `old`
            await asyncio.wait_for(old.closed.wait(), LONG_S)
            await until_gone(ref, "the swept connection")


@on_both_loops
async def test_a_connection_the_replica_closes_after_its_answer_is_freed_once_the_response_is() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b'{"ok": 1}'), then_close=True)) as server:
            response = await post(pool, server.url)
            assert await response.read_all(LONG_S) == b'{"ok": 1}'
            ref = weakref.ref(response._connection)
            response.release()
            del response
            await until_gone(ref, "the connection the replica closed")
            assert server.num_connections == 1
