"""A replica's URL stays inside the gateway: clients, metrics, admin pages and logs name it by an opaque id.

A static replica at `http://user:secret@127.0.0.1:PORT` (a real aiohttp server on loopback that asks for
those Basic credentials) is served as `m-static-0`: the password and the address appear in no answer, header,
metric label, admin page or log line, while the proxy still connects to it with its credentials.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvgate.router.proxy import REPLICA_HEADER
from kvgate.router.upstream import UpstreamError, UpstreamPool
from tests.eventually import eventually
from tests.router.sim_gateway import Gateway, chat, gateway, hand_written_replica

SECRET = "s3cret-pw"
BASIC = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
ANSWER = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


async def answer(request: web.Request) -> web.StreamResponse:
    """A chat completion, streamed or not, for a client that sends the replica's Basic credentials."""
    if request.headers.get("Authorization") != BASIC:
        return web.json_response({"error": {"message": "who are you?"}}, status=401)
    if not (await request.json()).get("stream"):
        return web.json_response(ANSWER)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
    await response.write_eof()
    return response


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://user:{SECRET}@")


def hides_the_replica(text: str, port: int) -> bool:
    return SECRET not in text and f":{port}" not in text


async def get(gw: Gateway, path: str) -> tuple[dict, str]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + path) as r:
        assert r.status == 200, (path, await r.text())
        return dict(r.headers), await r.text()


async def test_a_replica_with_credentials_is_named_by_its_id_in_answers_metrics_admin_pages_and_logs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with hand_written_replica(chat_completions=answer) as url:
        port = int(url.rsplit(":", 1)[1])
        async with gateway(tmp_path, num_replicas=0, other_urls=(with_credentials(url),)) as gw:
            seen = []
            for stream in (False, True):
                status, headers, body = await gw.post("/v1/chat/completions",
                                                      json.dumps(chat("Hello", stream=stream)).encode())
                assert status == 200 and '"hi"' in body  # the replica let the gateway in: it sent the credentials
                assert headers[REPLICA_HEADER] == "m-static-0"
                seen.append(json.dumps(headers) + body)
            for path in ("/metrics", "/admin/stats", "/admin/history", "/dashboard", "/health", "/v1/models"):
                headers, body = await get(gw, path)
                seen.append(json.dumps(headers) + body)
            _, metrics = await get(gw, "/metrics")
            assert 'replica="m-static-0"' in metrics
            stats = json.loads((await get(gw, "/admin/stats"))[1])
            [replica] = stats["models"]["m"]["replicas"]
            # Operators see which server it is, without its user part.
            assert (replica["replica_id"], replica["url"]) == ("m-static-0", url)
    assert all(SECRET not in text for text in seen)
    assert all(f":{port}" not in text for text in seen[:2])  # no client learns the internal address
    assert SECRET not in caplog.text


async def test_a_replica_that_cannot_be_reached_is_named_by_its_id_in_the_error_and_the_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The 502's message and the ejection's log line name `m-static-0`, not `user:secret@host:port`."""
    caplog.set_level(logging.DEBUG)
    async with contextlib.AsyncExitStack() as replica:
        url = await replica.enter_async_context(hand_written_replica(chat_completions=answer))
        port = int(url.rsplit(":", 1)[1])
        async with gateway(tmp_path, num_replicas=0, other_urls=(with_credentials(url),)) as gw:
            assert (await gw.post("/v1/chat/completions", json.dumps(chat("Hello")).encode()))[0] == 200
            await replica.aclose()  # the replica goes away; the gateway's next health check is 60 s off
            errors = [await gw.post("/v1/chat/completions", json.dumps(chat("Hello")).encode()) for _ in range(3)]
    assert [status for status, _, _ in errors] == [502] * 3
    for _, headers, body in errors:
        assert "replica m-static-0 could not be reached" in body
        assert hides_the_replica(json.dumps(headers) + body, port)
    assert "replica m-static-0 ejected" in caplog.text  # the third failure in a row
    assert SECRET not in caplog.text


async def test_a_replica_url_that_does_not_parse_is_logged_without_its_credentials(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's InvalidURL quotes the whole URL: the failed health check's line gives only its class."""
    caplog.set_level(logging.DEBUG)
    async with gateway(tmp_path, num_replicas=0, other_urls=(f"http://user:{SECRET}@127.0.0.1:99999",)) as gw:
        await eventually(lambda: not gw.tracker.view("m").replicas[0].healthy)  # its first health check failed
    assert "health check of replica m-static-0 failed: InvalidUrlClientError" in caplog.text
    assert SECRET not in caplog.text


@pytest.mark.parametrize("url", [f"http://user:{SECRET}@127.0.0.1:99999", f"ftp://user:{SECRET}@127.0.0.1:21"])
async def test_the_upstream_client_names_a_bad_replica_url_without_its_credentials(url: str) -> None:
    pool = UpstreamPool()
    try:
        with pytest.raises(UpstreamError, match="127.0.0.1") as raised:
            await pool.post(url, "/v1/chat/completions", b"{}", connect_timeout_s=1.0, timeout_s=1.0)
    finally:
        await pool.close()
    assert SECRET not in str(raised.value) and "user" not in str(raised.value)
