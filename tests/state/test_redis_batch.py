"""`redis_batch.ScriptBatcher` against a real redis-server: calls made while a batch is on its way go together as
the next, a server that lost its scripts gets them again, and errors reach every caller of their batch."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from kvgate.state import StateStoreUnavailable
from kvgate.state.quota import BucketTake, Slot
from kvgate.state.redis_batch import Script, ScriptBatcher
from tests.state.conftest import MakeRedisStore

INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
SCRIPT = Script(INCR, hashlib.sha1(INCR.encode()).hexdigest())


class CountedPipelines(aioredis.Redis):
    """A real client that counts the pipelines it runs."""

    executed = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a: Any, **k: Any) -> Any:
            type(self).executed += 1
            return await execute(*a, **k)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe


async def test_calls_made_together_go_in_one_pipeline_and_each_gets_its_own_reply(redis_url: str,
                                                                                   prefix: str) -> None:
    client = CountedPipelines.from_url(redis_url, decode_responses=True)
    batcher = ScriptBatcher(client)
    try:
        replies = await asyncio.gather(*(batcher.call(SCRIPT, [f"{prefix}n"], [1]) for _ in range(100)))
        alone = await batcher.call(SCRIPT, [f"{prefix}n"], [5])
    finally:
        await batcher.close()
        await client.aclose()
    assert sorted(replies) == list(range(1, 101)) and alone == 105
    assert CountedPipelines.executed == 2  # the 100 made together, then the one alone


async def test_a_server_that_lost_its_scripts_gets_them_again(redis_url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    batcher = ScriptBatcher(client)
    try:
        assert await batcher.call(SCRIPT, [f"{prefix}n"], [1]) == 1
        await client.script_flush()  # what a restarted or failed-over server has forgotten
        assert await asyncio.gather(*(batcher.call(SCRIPT, [f"{prefix}n"], [1]) for _ in range(3))) == [2, 3, 4]
    finally:
        await batcher.close()
        await client.aclose()


async def test_a_command_error_reaches_only_its_own_caller(redis_url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.set(f"{prefix}text", "not a number")
    batcher = ScriptBatcher(client)
    try:
        good, bad = await asyncio.gather(batcher.call(SCRIPT, [f"{prefix}n"], [1]),
                                         batcher.call(SCRIPT, [f"{prefix}text"], [1]), return_exceptions=True)
    finally:
        await batcher.close()
        await client.aclose()
    assert good == 1 and isinstance(bad, redis.exceptions.ResponseError)


async def test_an_unreachable_server_fails_every_call_of_the_batch_as_unavailable(
        make_redis_store: MakeRedisStore, unreachable_redis_url: str) -> None:
    store = make_redis_store(url=unreachable_redis_url, timeout_s=0.5)
    slot = Slot("{t}:in_flight", 1, 60)
    results = await asyncio.gather(*(store.take_quota(slot, [BucketTake("{t}:r", 10, 1, 1)]) for _ in range(5)),
                                   return_exceptions=True)
    assert all(isinstance(result, StateStoreUnavailable) for result in results), results


async def test_closing_fails_what_was_not_sent(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    batcher = ScriptBatcher(client)
    calls = [asyncio.ensure_future(batcher.call(SCRIPT, ["k"], [1])) for _ in range(3)]
    await asyncio.sleep(0)  # the calls are queued; their batch has not been sent
    await batcher.close()
    results = await asyncio.gather(*calls, return_exceptions=True)
    await client.aclose()
    assert all(isinstance(result, redis.exceptions.ConnectionError) for result in results), results
