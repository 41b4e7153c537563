"""Fixtures for the state store suite: every `store` test runs once per implementation."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from kvgate.clock import FakeClock
from kvgate.state import MemoryStateStore, RedisStateStore, StateStore

MakeRedisStore = Callable[..., RedisStateStore]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests sharing the session's Redis never see each other."""
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def unreachable_redis_url() -> str:
    """A redis:// URL on a loopback port nobody listens on: connections are refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.fixture
async def make_redis_store(
    redis_url: str, clock: FakeClock, prefix: str
) -> AsyncIterator[MakeRedisStore]:
    """Builds RedisStateStores on the session's server (one per "gateway"), closed after the test.
    Defaults: this test's clock and prefix."""
    stores: list[RedisStateStore] = []

    def make(
        *, url: str = redis_url, clock: FakeClock = clock, prefix: str = prefix, timeout_s: float = 2.0
    ) -> RedisStateStore:
        store = RedisStateStore.from_url(url, clock, prefix=prefix, timeout_s=timeout_s)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, clock: FakeClock
) -> AsyncIterator[StateStore]:
    """The store under test, on a FakeClock. The Redis one talks to a real redis-server."""
    if request.param == "memory":
        memory = MemoryStateStore(clock)
        yield memory
        await memory.close()
    else:
        # Looked up only here, so the memory half of the suite runs without a redis-server.
        redis_url: str = request.getfixturevalue("redis_url")
        redis = RedisStateStore.from_url(redis_url, clock, prefix=request.getfixturevalue("prefix"))
        yield redis
        await redis.close()
