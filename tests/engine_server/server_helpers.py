"""Helpers of the replica-server suites: a deterministic clock, settings, an app client, SSE parsing."""

from __future__ import annotations

import itertools
import json
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from kvgate.engine.server.app import build_app
from kvgate.engine.server.context import ServerSettings

MODEL = "tiny"


class StepClock:
    """A server clock that moves one second per reading: arrival t, first token t+1, next token t+2..."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self._ticks))


def make_settings(**overrides: Any) -> ServerSettings:
    return ServerSettings(**{"served_model_name": MODEL, "now": StepClock(), "wall": lambda: 1_700_000_000.0,
                             **overrides})


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
