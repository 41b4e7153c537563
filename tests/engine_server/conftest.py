"""Fixtures of the replica-server suites: one real engine on builtin:tiny-llama per module, and an app
over it per test (aiohttp's real-socket TestServer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp.test_utils import TestClient

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core import EngineConfig, EngineCore
from tests.engine.builtin_cache import tiny_llama_dir
from tests.engine_server.server_helpers import make_settings, start_client


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    # 4 MiB of KV cache is 512 blocks of 16 tokens for tiny-llama: room for every test at once.
    llm = AsyncLLM(EngineCore(EngineConfig(model=str(tiny_llama_dir()), kv_cache_bytes=4 << 20, max_num_seqs=16)))
    yield llm
    asyncio.run(llm.close())


@pytest.fixture
async def client(engine: AsyncLLM) -> AsyncIterator[TestClient]:
    client = await start_client(engine, make_settings())
    yield client
    await client.close()
