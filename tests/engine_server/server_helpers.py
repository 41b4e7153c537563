"""Helpers of the replica-server suites: a deterministic clock, settings, an app client, SSE parsing, and
engines without (or with fake) multi-LoRA."""

from __future__ import annotations

import itertools
import json
from typing import Any

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.server.adapter_access import AdapterAccess, adapter_root
from kvgate.engine.server.app import build_app
from kvgate.engine.server.context import ServerSettings

MODEL = "tiny"


class StepClock:
    """A server clock that moves one second per reading: arrival t, first token t+1, next token t+2..."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self._ticks))


def open_adapters(*roots: Path | str, token: str | None = None) -> AdapterAccess:
    """The adapter endpoints as `kvgate engine` on loopback serves them, loading from under `roots`."""
    return AdapterAccess(token=token, open_without_token=True, roots=tuple(adapter_root(str(r)) for r in roots))


def make_settings(**overrides: Any) -> ServerSettings:
    """Settings of a test server: a StepClock, a fixed wall clock, adapter endpoints open with no roots."""
    return ServerSettings(**{"served_model_name": MODEL, "now": StepClock(), "wall": lambda: 1_700_000_000.0,
                             "adapter_access": open_adapters(), **overrides})


async def start_client(engine: Any, settings: ServerSettings) -> TestClient:
    client = TestClient(TestServer(build_app(engine, settings)))
    await client.start_server()
    return client


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of a server-sent-event body, JSON-decoded, with [DONE] kept as a string."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class WithoutLoRA:
    """The engine as it is without multi-LoRA: no adapter methods."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        if name in ("load_adapter", "unload_adapter", "adapters"):
            raise AttributeError(name)
        return getattr(self._engine, name)


class AdapterInfo:
    def __init__(self, registered: tuple[str, ...], loaded: tuple[str, ...]) -> None:
        self.registered, self.loaded = registered, loaded


class FakeLoRA(WithoutLoRA):
    """The engine with fake adapter bookkeeping, to check the HTTP side of multi-LoRA: `sources` holds the
    source each load reached the engine with."""

    def __init__(self, engine: AsyncLLM) -> None:
        super().__init__(engine)
        self.sources: dict[str, str] = {}

    async def load_adapter(self, name: str, source: str) -> None:
        self.sources[name] = source

    async def unload_adapter(self, name: str) -> bool:
        return self.sources.pop(name, None) is not None

    def adapters(self) -> AdapterInfo:
        return AdapterInfo(tuple(self.sources), tuple(self.sources))
