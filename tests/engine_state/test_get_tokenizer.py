"""Replica.GetTokenizer: a gateway builds, from the files one replica sends, exactly the tokenizer that
replica uses, so that it hashes a chat prompt into the same KV block chain as the replica's prefix cache.

A real engine (builtin:tiny-llama, whose tokenizer_config.json holds a chat template that writes the
BOS itself), the real gRPC server on a loopback port, the generated client stub over a real channel.
The "with_jinja" model directory is a copy of it plus a chat_template.jinja (which wins over the
config's template, in the engine and so in the gateway) and a file that is not a tokenizer file.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core import EngineConfig
from kvgate.engine.server.context import Lifecycle, ServerContext, ServerSettings
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.server.protocol import ChatMessage
from kvgate.engine.sequence import SamplingParams
from kvgate.engine.state_service import start_state_service
from kvgate.kv_blocks import hash_blocks
from kvgate.tokenizer import TOKENIZER_FILES, Tokenizer
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from tests.engine.builtin_cache import tiny_llama_dir

BLOCK_SIZE = 8  # not the engine's default 16: the answer must carry the configured size
# Llama-3 style: headers per message, BOS written by the template, a different text than the config's.
JINJA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHAT = [
    ChatMessage("system", "You are a terse assistant. Answer in one sentence."),
    ChatMessage("user", "Which replica holds the longest prefix of this prompt, and why does it matter?"),
]


def model_dir(tmp_path: Path, variant: str) -> Path:
    """A private copy of the tiny-llama directory (tests may edit it), in one of two variants."""
    directory = tmp_path / f"tiny-llama-{variant}"
    shutil.copytree(tiny_llama_dir(), directory)
    if variant == "with_jinja":
        (directory / "chat_template.jinja").write_text(JINJA_TEMPLATE)
        (directory / "special_tokens_map.json").write_text('{"bos_token": "<|begin_of_text|>"}')
    return directory


async def start_engine(directory: Path) -> AsyncLLM:
    return await AsyncLLM.create(EngineConfig(model=str(directory), kv_cache_bytes=4 << 20, max_num_seqs=8,
                                              block_size=BLOCK_SIZE, enable_kv_events=True))


class Served:
    """An engine's state service and a client of it, stopped in reverse order by `close`."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    async def start(self) -> Served:
        self.service = await start_state_service(self.engine, host="127.0.0.1", port=0,
                                                 replica_id="tiny-llama-0", model="tiny-llama")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = replica_pb2_grpc.ReplicaStub(self.channel)
        return self

    async def close(self) -> None:
        await self.channel.close()
        await self.service.stop(grace=None)
        await self.engine.close()


@pytest.fixture(params=["stock", "with_jinja"])
async def served(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Served]:
    running = await Served(await start_engine(model_dir(tmp_path, request.param))).start()
    try:
        yield running
    finally:
        await running.close()


async def get_tokenizer(served: Served) -> replica_pb2.TokenizerFiles:
    return await served.stub.GetTokenizer(replica_pb2.GetTokenizerRequest(), timeout=5)


async def test_get_tokenizer_sends_the_model_dirs_tokenizer_files_and_block_size(served: Served) -> None:
    directory = Path(served.engine.core.model_dir)

    answer = await get_tokenizer(served)

    on_disk = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}
    assert dict(answer.files) == on_disk  # every tokenizer file there, byte for byte, and nothing else
    assert "tokenizer.json" in answer.files
    assert ("chat_template.jinja" in answer.files) == (directory / "chat_template.jinja").is_file()
    assert answer.block_size_tokens == BLOCK_SIZE == served.engine.stats.block_size_tokens


async def test_the_answer_is_read_once_at_start_not_per_call(served: Served) -> None:
    directory = Path(served.engine.core.model_dir)
    first = await get_tokenizer(served)

    (directory / "chat_template.jinja").write_text("{{ 'edited after the engine started' }}")
    (directory / "tokenizer_config.json").unlink()
    again = await get_tokenizer(served)

    assert again == first  # what the engine loaded, not what the disk says now


async def test_a_tokenizer_from_the_files_renders_and_encodes_like_the_engines(served: Served) -> None:
    engine_tokenizer = served.engine.core.tokenizer

    gateway_tokenizer = Tokenizer.from_files((await get_tokenizer(served)).files, "replica tiny-llama-0")

    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    rendered = gateway_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == engine_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.startswith("<|begin_of_text|>")  # the template's own BOS, in both variants
    assert gateway_tokenizer.encode(rendered, add_special_tokens=False) == \
        engine_tokenizer.encode(rendered, add_special_tokens=False)
    text = "Plain completions get the tokenizer's BOS: ünïcödé, 12345, <|im_end|>."
    assert gateway_tokenizer.encode(text) == engine_tokenizer.encode(text)
    assert (gateway_tokenizer.bos_token_id, gateway_tokenizer.eos_token_ids) == \
        (engine_tokenizer.bos_token_id, engine_tokenizer.eos_token_ids)


async def test_gateway_hashes_of_a_chat_prompt_are_the_blocks_the_engine_stores(served: Served) -> None:
    answer = await get_tokenizer(served)
    gateway_tokenizer = Tokenizer.from_files(answer.files)
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    gateway_ids = gateway_tokenizer.encode(gateway_tokenizer.apply_chat_template(messages), add_special_tokens=False)
    gateway_hashes = hash_blocks(gateway_ids, answer.block_size_tokens)
    assert len(gateway_hashes) >= 4  # a chain long enough to mean something

    # The engine's own /v1/chat/completions path turns the chat into ids, then runs it.
    context = ServerContext(engine=served.engine, settings=ServerSettings("tiny-llama", warmup=False),
                            metrics=ServerMetrics(lambda: served.engine.stats, lambda: False), lifecycle=Lifecycle())
    engine_ids = await context.chat_prompt_ids(CHAT)
    assert engine_ids == gateway_ids
    async for _ in served.engine.generate(engine_ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)):
        pass

    assert set(gateway_hashes) <= set(await served.engine.cached_block_hashes())


async def test_a_llama_3_sized_answer_needs_the_callers_receive_limit_raised(tmp_path: Path) -> None:
    """tokenizer.json padded with JSON whitespace to 9 MB (Llama 3's is ~9 MB): the same tokenizer."""
    directory = model_dir(tmp_path, "stock")
    with (directory / "tokenizer.json").open("ab") as file:
        file.write(b" " * (9 << 20))
    served = await Served(await start_engine(directory)).start()
    raised = grpc.aio.insecure_channel(f"127.0.0.1:{served.service.port}",
                                       options=[("grpc.max_receive_message_length", 64 << 20)])
    try:
        answer = await replica_pb2_grpc.ReplicaStub(raised).GetTokenizer(replica_pb2.GetTokenizerRequest(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await get_tokenizer(served)  # a channel with gRPC's default 4 MiB receive limit
    finally:
        await raised.close()
        await served.close()

    assert len(answer.files["tokenizer.json"]) > 9 << 20
    text = "the same tokenizer"
    assert Tokenizer.from_files(answer.files).encode(text) == served.engine.core.tokenizer.encode(text)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_without_tokenizer_json_get_tokenizer_fails_with_failed_precondition(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = model_dir(tmp_path, "stock")
    engine = await start_engine(directory)  # the engine loaded its tokenizer; then the file went away
    (directory / "tokenizer.json").unlink()
    served = await Served(engine).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await get_tokenizer(served)
        state = await served.stub.GetState(replica_pb2.GetStateRequest(), timeout=5)
    finally:
        await served.close()

    assert failure.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert f"{directory / 'tokenizer.json'}: missing" in failure.value.details()
    assert state.block_size_tokens == BLOCK_SIZE  # the state service itself still serves
    assert "GetTokenizer will fail with FAILED_PRECONDITION" in caplog.text
