"""AsyncLLM: engine steps on a worker thread, tokens streamed per request to asyncio consumers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvgate.engine import FinishReason, SamplingParams
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core import EngineConfig
from tests.engine.builtin_cache import tiny_llama_dir
from tests.engine.test_llm import prompts, sharp_model  # noqa: F401  (the fixture)
from tests.eventually import eventually

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def engine(sharp_model):  # noqa: F811
    llm = await AsyncLLM.create(EngineConfig(model=str(sharp_model), kv_cache_bytes=4 << 20, max_num_seqs=8))
    yield llm
    await llm.close()


async def collect(llm: AsyncLLM, prompt, params=GREEDY):
    return [delta async for delta in llm.generate(prompt, params)]


async def test_concurrent_streams_match_the_offline_engine(engine: AsyncLLM) -> None:
    batch = prompts(4, seed=11)
    streams = await asyncio.gather(*(collect(engine, p) for p in batch))
    from kvgate.engine import LLM

    offline = LLM(str(engine.core.model_dir), kv_cache_bytes=4 << 20).generate(batch, GREEDY)
    assert [[d.token_id for d in s] for s in streams] == [o.token_ids for o in offline]
    assert ["".join(d.text for d in s) for s in streams] == [o.text for o in offline]
    assert all(s[-1].finish_reason is FinishReason.LENGTH for s in streams)
    assert all(d.finish_reason is None for s in streams for d in s[:-1])


async def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(engine: AsyncLLM) -> None:
    blocks = engine.core.block_manager
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    seen = 0
    async for _ in engine.generate(prompts(1, seed=12)[0], long):
        seen += 1
        if seen == 3:
            break  # the client went away
    await eventually(lambda: blocks.num_free_blocks == blocks.num_total_blocks and not engine.core.has_unfinished(),
                     "the abort applied at the worker's next step boundary: blocks free, nothing unfinished")


async def test_cancelling_the_reading_task_aborts_too(engine: AsyncLLM) -> None:
    started = asyncio.Event()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def reader() -> None:
        async for _ in engine.generate(prompts(1, seed=13)[0], long):
            started.set()

    task = asyncio.create_task(reader())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: not engine.core.has_unfinished(), "the cancelled request aborted")


async def test_a_bad_prompt_raises_before_streaming_and_the_engine_carries_on(engine: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        await collect(engine, [])
    assert len(await collect(engine, prompts(1)[0])) == 16


async def test_closed_engine_refuses_new_work(tmp_path) -> None:
    llm = await AsyncLLM.create(EngineConfig(model=str(tiny_llama_dir()), kv_cache_bytes=2 << 20))
    await llm.close()
    assert not llm.is_alive
    with pytest.raises(RuntimeError, match="engine stopped"):
        await collect(llm, [5, 6, 7])


async def test_stats_are_published_as_the_engine_works(engine: AsyncLLM) -> None:
    seen = []
    engine.on_stats(seen.append)
    await collect(engine, prompts(1, seed=14)[0])
    assert any(s.num_running == 1 for s in seen)
    final = engine.stats
    assert final.num_running == 0 and final.num_waiting == 0
    assert final.num_generated_tokens_total >= 16 and final.num_requests_finished_total >= 1
    assert final.num_kv_blocks_free == final.num_kv_blocks_total


async def test_cancelling_a_request_before_the_worker_takes_it_adds_nothing(engine: AsyncLLM) -> None:
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    for _ in range(5):  # the client leaves while the add waits in the command queue
        task = asyncio.ensure_future(anext(engine.generate(prompts(1, seed=15)[0], long)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # A request after them, served, means the worker has taken every command queued before it.
    assert len(await collect(engine, prompts(1)[0])) == 16
    assert engine.is_alive and not engine.core.has_unfinished()


async def test_cancelling_a_request_while_the_worker_adds_it_aborts_it(engine: AsyncLLM, monkeypatch) -> None:
    added, caller_cancelled = threading.Event(), threading.Event()
    real_add = engine.core.add_requests

    def slow_add(*args, **kwargs):
        added.set()
        caller_cancelled.wait(30)  # the caller is cancelled meanwhile: it never learns the request's id
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine.core, "add_requests", slow_add)
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    task = asyncio.ensure_future(anext(engine.generate(prompts(1, seed=16)[0], long)))
    await asyncio.to_thread(added.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    caller_cancelled.set()
    await eventually(lambda: engine.stats.num_requests_aborted_total and not engine.core.has_unfinished(),
                     "the request added for a caller that had left aborted")
    assert engine.is_alive
    assert engine.stats.num_requests_aborted_total == 1
