"""LoRA adapters over HTTP with the real multi-LoRA engine: vLLM's load/unload endpoints, adapters as
models, and the errors a client sees."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from kvgate.engine.async_llm import AsyncLLM
from tests.engine.peft_files import write_peft_dir
from tests.engine_server.server_helpers import MODEL, make_settings, open_adapters, start_client


@pytest.fixture
async def client(engine: AsyncLLM, tmp_path: Path) -> AsyncIterator[TestClient]:
    """The suite's client with the test's tmp_path as the one adapter root."""
    client = await start_client(engine, make_settings(adapter_access=open_adapters(tmp_path)))
    yield client
    await client.close()


async def test_a_loaded_adapter_is_a_model_clients_can_use_until_it_is_unloaded(
        client: TestClient, tmp_path: Path) -> None:
    source = write_peft_dir(tmp_path / "sql")
    loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(source)})
    assert loaded.status == 200, await loaded.text()
    models = (await (await client.get("/v1/models")).json())["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("sql", MODEL)]

    request = {"model": "sql", "prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    answer = await client.post("/v1/completions", json=request)
    assert answer.status == 200 and (await answer.json())["model"] == "sql"

    assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status == 200
    gone = await client.post("/v1/completions", json=request)
    assert gone.status == 404 and (await gone.json())["error"]["code"] == "model_not_found"


async def test_an_adapter_that_cannot_load_is_a_400_naming_lora_path(client: TestClient, tmp_path: Path) -> None:
    response = await client.post("/v1/load_lora_adapter",
                                 json={"lora_name": "broken", "lora_path": str(tmp_path / "missing")})
    error = (await response.json())["error"]
    assert (response.status, error["param"], error["code"]) == (400, "lora_path", "adapter_load_failed")
    assert "broken" not in [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]


async def test_an_adapter_cannot_take_the_base_models_name(client: TestClient, tmp_path: Path) -> None:
    response = await client.post("/v1/load_lora_adapter",
                                 json={"lora_name": MODEL, "lora_path": str(write_peft_dir(tmp_path / "a"))})
    assert response.status == 400 and (await response.json())["error"]["param"] == "lora_name"
