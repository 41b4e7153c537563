"""Multi-LoRA through AsyncLLM, the server's interface: load and unload between steps, adapter errors
raised to the right caller only, and requests that outlive an unload."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core import EngineConfig
from kvgate.engine.lora import AdapterInfo, AdapterLoadError, UnknownAdapter
from tests.engine.hf_models import hf_greedy
from tests.engine.test_lora import GREEDY, NUM_NEW, Tiny, prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("lora-async"))


async def start(tiny: Tiny, **overrides) -> AsyncLLM:
    settings = {"model": str(tiny.model_dir), "kv_cache_bytes": 2 << 20, **overrides}
    return await AsyncLLM.create(EngineConfig(**settings))


async def collect(llm: AsyncLLM, prompt, adapter: str | None) -> list[int]:
    return [delta.token_id async for delta in llm.generate(prompt, GREEDY, adapter)]


async def test_an_adapter_loaded_through_async_llm_serves_and_unloads(tiny: Tiny) -> None:
    llm = await start(tiny)
    try:
        await llm.load_adapter("sql", str(tiny.adapter_dirs["sql"]))
        assert llm.adapters() == AdapterInfo(registered=("sql",), loaded=("sql",))  # published before return
        assert llm.stats.adapters_loaded == ("sql",) and llm.stats.num_adapter_loads_total == 1

        [prompt] = prompts(1, seed=10)
        assert await collect(llm, prompt, "sql") == hf_greedy(tiny.merged["sql"], prompt, NUM_NEW)

        assert await llm.unload_adapter("sql") is True
        assert await llm.unload_adapter("sql") is False
        assert llm.adapters() == AdapterInfo(registered=(), loaded=())
        with pytest.raises(UnknownAdapter):
            await collect(llm, prompt, "sql")
    finally:
        await llm.close()


async def test_a_failed_load_raises_to_its_caller_and_the_engine_keeps_serving(tiny: Tiny, tmp_path) -> None:
    llm = await start(tiny)
    try:
        with pytest.raises(AdapterLoadError, match="no such adapter directory"):
            await llm.load_adapter("ghost", str(tmp_path / "nowhere"))
        assert llm.is_alive and llm.adapters() == AdapterInfo(registered=(), loaded=())
        assert len(await collect(llm, prompts(1)[0], None)) == NUM_NEW
    finally:
        await llm.close()


async def test_a_request_whose_adapter_cannot_load_gets_the_error_and_the_others_finish(
        tiny: Tiny, tmp_path: Path) -> None:
    chat = tmp_path / "chat"
    shutil.copytree(tiny.adapter_dirs["chat"], chat)
    llm = await start(tiny, max_loras=1, adapters=(("sql", str(tiny.adapter_dirs["sql"])), ("chat", str(chat))))
    weights = chat / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # damaged after validation, before its first load
    try:
        base, broken, sql = await asyncio.gather(
            collect(llm, prompts(1, seed=11)[0], None), collect(llm, prompts(1, seed=12)[0], "chat"),
            collect(llm, prompts(1, seed=13)[0], "sql"), return_exceptions=True)
        assert isinstance(broken, AdapterLoadError) and "cannot read the adapter's tensors" in str(broken)
        assert len(base) == NUM_NEW and sql == hf_greedy(tiny.merged["sql"], prompts(1, seed=13)[0], NUM_NEW)
        assert llm.stats.num_running == 0 and llm.stats.num_waiting == 0
    finally:
        await llm.close()


async def test_a_request_streaming_when_its_adapter_is_unloaded_finishes_with_it(tiny: Tiny) -> None:
    llm = await start(tiny, adapters=(("chat", str(tiny.adapter_dirs["chat"])),))
    [prompt] = prompts(1, seed=14)
    try:
        stream = llm.generate(prompt, GREEDY, "chat")
        first = await anext(stream)

        assert await llm.unload_adapter("chat") is True
        assert llm.adapters() == AdapterInfo(registered=(), loaded=())  # gone for new requests
        rest = [delta.token_id async for delta in stream]

        assert [first.token_id, *rest] == hf_greedy(tiny.merged["chat"], prompt, NUM_NEW)
        with pytest.raises(UnknownAdapter):
            await collect(llm, prompt, "chat")
    finally:
        await llm.close()
