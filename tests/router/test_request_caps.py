"""Per-model caps on max_tokens, n and prompt size (the registry's `limits`), and the count of every request the
gateway refuses itself: a real gateway over a hand-written replica that records what reaches it."""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.router.app_keys import GatewaySettings
from tests.router.sim_gateway import gateway, hand_written_replica

FRONTED_CAP = 1 << 20  # the max_tokens cap of a model fronting servers whose length the registry does not know
CAPPED = "limits: {max_tokens: 100, max_n: 2, max_prompt_chars: 50}"


@dataclass
class Fronted:
    url: str  # the gateway's
    received: list[dict]  # the bodies that reached the replica

    async def post(self, path: str, body: object, **kwargs: object) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with aiohttp.ClientSession() as s, s.post(self.url + path, data=data, **kwargs) as r:
            return r.status, await r.json(content_type=None)

    async def refusals(self) -> dict[tuple[str, str, str], float]:
        """(model, reason, status) -> count over every tenant, from /metrics."""
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as r:
            text = await r.text()
        counts: dict[tuple[str, str, str], float] = collections.defaultdict(float)
        for line in text.splitlines():
            if line.startswith("kvgate_router_refused_requests_total{"):
                labels, value = line.removeprefix("kvgate_router_refused_requests_total").rsplit(" ", 1)
                pairs = dict(pair.split("=", 1) for pair in labels.strip("{}").split(","))
                counts[tuple(pairs[k].strip('"') for k in ("model", "reason", "status"))] += float(value)
        return dict(counts)


def chat(model: str, content: str = "hi", **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


@contextlib.asynccontextmanager
async def fronting(tmp_path: Path, spec: str = "", settings: GatewaySettings | None = None
                   ) -> AsyncIterator[Fronted]:
    """The router tests' registry (`sim_gateway`): model `m`, with `spec` added, and its adapter `sql` in front of
    one replica that records each body and answers 200; `cold`, whose replicas kvgate would start (none runs),
    with the default engine length of 2,048 tokens."""
    received: list[dict] = []

    async def answer(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async with hand_written_replica(chat_completions=answer, completions=answer) as url, \
            gateway(tmp_path, num_replicas=0, other_urls=(url,), settings=settings, spec=spec) as gw:
        yield Fronted(gw.url, received)


async def test_the_probes_max_tokens_and_n_get_400_naming_the_field_and_the_cap_and_never_reach_a_replica(
        tmp_path: Path) -> None:
    """10^12 tokens and 10^6 choices against a model's default caps (it fronts a server whose length the
    registry does not know)."""
    over = [("max_tokens", 10**12, FRONTED_CAP), ("max_completion_tokens", 10**12, FRONTED_CAP),
            ("n", 10**6, 16), ("best_of", 17, 16)]
    async with fronting(tmp_path) as gw:
        for field, value, cap in over:
            status, answer = await gw.post("/v1/chat/completions", chat("m", **{field: value}))
            assert status == 400, (field, answer)
            assert answer["error"] == {"message": f"'{field}' is {value}; model 'm' takes at most {cap}",
                                       "type": "BadRequestError", "param": field, "code": "integer_above_max_value"}
        assert gw.received == []


async def test_one_past_each_cap_the_registry_sets_gets_400_and_an_adapter_has_its_base_models_caps(
        tmp_path: Path) -> None:
    over = [("m", "max_tokens", 101, 100), ("m", "n", 3, 2), ("sql", "max_completion_tokens", 101, 100),
            ("sql", "best_of", 3, 2)]
    async with fronting(tmp_path, CAPPED) as gw:
        for model, field, value, cap in over:
            status, answer = await gw.post("/v1/chat/completions", chat(model, **{field: value}))
            assert (status, answer["error"]["param"]) == (400, field), (model, field, answer)
            assert f"'{field}' is {value}; model 'm' takes at most {cap}" == answer["error"]["message"]
        assert gw.received == []


async def test_requests_at_the_caps_pass_through(tmp_path: Path) -> None:
    async with fronting(tmp_path) as gw:
        for body in chat("m", max_tokens=FRONTED_CAP, n=16), chat("m", max_completion_tokens=FRONTED_CAP, best_of=16):
            status, answer = await gw.post("/v1/chat/completions", body)
            assert status == 200, (body, answer)
        assert len(gw.received) == 2
    async with fronting(tmp_path, CAPPED) as gw:
        for body in chat("m", max_tokens=100, n=2), chat("sql", content="x" * 44):  # "\x1e" + role + "\x1f" + 44
            status, answer = await gw.post("/v1/chat/completions", body)
            assert status == 200, (body, answer)
        status, _ = await gw.post("/v1/completions", {"model": "m", "prompt": "x" * 50})
        assert status == 200
        assert len(gw.received) == 3


async def test_a_prompt_over_the_models_character_cap_gets_400_naming_messages_or_prompt(tmp_path: Path) -> None:
    """Characters of the prompt as the gateway renders it: a chat message is its role and content plus 2."""
    async with fronting(tmp_path, CAPPED) as gw:
        status, answer = await gw.post("/v1/chat/completions", chat("sql", content="x" * 45))  # 51 characters
        assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, "messages", "prompt_too_long")
        assert "51 characters; model 'm' takes at most 50" in answer["error"]["message"]
        status, answer = await gw.post("/v1/completions", {"model": "m", "prompt": "x" * 51})
        assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, "prompt", "prompt_too_long")
        assert gw.received == []
    async with fronting(tmp_path) as gw:  # no cap set: the body limit alone
        status, _ = await gw.post("/v1/completions", {"model": "m", "prompt": "x" * 100_000})
        assert status == 200


async def test_a_capped_field_that_is_not_an_integer_gets_400_rather_than_slip_past_the_cap(tmp_path: Path) -> None:
    """1e12 parses as a float and "1000000000000" is a string: servers that coerce either would take 10^12."""
    async with fronting(tmp_path) as gw:
        for field, value, kind in [("max_tokens", 1e12, "a number"), ("max_tokens", "1000000000000", "a string"),
                                   ("n", 2.0, "a number"), ("max_completion_tokens", True, "a boolean")]:
            status, answer = await gw.post("/v1/chat/completions", chat("m", **{field: value}))
            assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, field, "invalid_type")
            assert f"'{field}' must be an integer; got {kind}" in answer["error"]["message"]
        assert gw.received == []
        status, _ = await gw.post("/v1/chat/completions", chat("m", max_tokens=None, n=None))  # null: unset
        assert status == 200


async def test_a_capped_field_below_1_gets_400_naming_it(tmp_path: Path) -> None:
    """As OpenAI answers: a negative max_tokens beside a large max_completion_tokens would shrink what a tenant
    reserves of its tokens per minute, and n 0 means nothing."""
    async with fronting(tmp_path) as gw:
        for field, value in [("max_tokens", -5), ("max_completion_tokens", 0), ("n", 0), ("best_of", -1)]:
            status, answer = await gw.post("/v1/chat/completions",
                                           chat("m", **{"max_completion_tokens": 200, field: value}))
            assert status == 400, (field, answer)
            assert answer["error"] == {"message": f"'{field}' is {value}; it must be at least 1",
                                       "type": "BadRequestError", "param": field, "code": "integer_below_min_value"}
        assert gw.received == []
        status, _ = await gw.post("/v1/chat/completions", chat("m", max_tokens=1, n=1, best_of=1))
        assert status == 200


async def test_a_model_kvgate_starts_is_capped_at_its_engine_length_before_it_waits_for_a_replica(
        tmp_path: Path) -> None:
    async with fronting(tmp_path) as gw:
        status, answer = await gw.post("/v1/completions", {"model": "cold", "prompt": "hi", "max_tokens": 2049})
        assert (status, answer["error"]["param"]) == (400, "max_tokens")
        assert "takes at most 2048" in answer["error"]["message"]
        status, answer = await gw.post("/v1/completions", {"model": "cold", "prompt": "hi", "max_tokens": 2048})
        assert (status, answer["error"]["code"]) == (503, "no_capacity")  # within the cap: it waited, no replica


async def test_every_refusal_is_counted_under_its_reason_with_only_declared_models_as_labels(
        tmp_path: Path) -> None:
    async with fronting(tmp_path, CAPPED, GatewaySettings(max_body_bytes=4096)) as gw:
        sent = [("/v1/chat/completions", b"{not json", 400),
                ("/v1/chat/completions", chat("made-up-model"), 404),
                ("/v1/chat/completions", {"model": "m"}, 400),  # no messages
                ("/v1/chat/completions", chat("m", max_tokens=500), 400),
                ("/v1/chat/completions", chat("sql", n=5), 400),
                ("/v1/chat/completions", chat("m", content="x" * 5000), 413),
                ("/v1/completions", {"model": "cold", "prompt": "hi"}, 503)]
        for path, body, expected in sent:
            status, _ = await gw.post(path, body)
            assert status == expected, (path, body)
        # Refused from its Content-Length alone, before the client sends the body (no 100 Continue).
        status, _ = await gw.post("/v1/chat/completions", b"x" * 5000, expect100=True)
        assert status == 413
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/nothing-here") as r:
                assert r.status == 404
            async with s.get(gw.url + "/v1/chat/completions") as r:
                assert r.status == 405
        assert await gw.refusals() == {
            ("_unknown", "bad_json", "400"): 1,
            ("_unknown", "unknown_model", "404"): 1,
            ("_unknown", "invalid_request", "400"): 1,
            ("m", "over_cap", "400"): 2,  # the adapter's refusal counts under its base model
            ("_unknown", "too_large", "413"): 2,
            ("cold", "no_capacity", "503"): 1,
            ("_unknown", "not_found", "404"): 1,
            ("_unknown", "method", "405"): 1,
        }
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            assert "made-up-model" not in await r.text()
        assert gw.received == []
