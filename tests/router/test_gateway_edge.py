"""The gateway's HTTP edge against clients that misbehave below JSON: bodies that cannot be read or never
finish, headers that are not UTF-8, idle connections, HTTP/1.0, clients that leave. Raw sockets where an
HTTP client would not send the bytes. Over simulated replicas (`tests.router.sim_gateway`)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.router import handlers
from kvgate.router.app_keys import GatewaySettings
from tests.eventually import eventually
from tests.router.sim_gateway import chat, gateway, hand_written_replica

CHAT = json.dumps(chat("hello")).encode()


async def exchange(url: str, data: bytes, then: bytes = b"", after_s: float = 0.0, timeout_s: float = 5.0,
                   answer_only: bool = False) -> bytes:
    """Send `data` on a fresh connection (and `then` after `after_s`), then read until the gateway closes it
    or `timeout_s` passes (with `answer_only`, until one whole answer with a Content-Length came); returns
    what came back."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        if then:
            await asyncio.sleep(after_s)
            writer.write(then)
        received = b""
        try:
            async with asyncio.timeout(timeout_s):
                while not (answer_only and whole_answer(received)) and (chunk := await reader.read(65536)):
                    received += chunk
        except TimeoutError:
            received += b"<still open>"
        return received
    finally:
        writer.close()


def whole_answer(received: bytes) -> bool:
    """Whether `received` holds an answer's head and all of the body its Content-Length announces."""
    head, separator, body = received.partition(b"\r\n\r\n")
    lengths = [line.partition(b":")[2] for line in head.split(b"\r\n")[1:]
               if line.partition(b":")[0].strip().lower() == b"content-length"]
    return bool(separator and lengths) and len(body) >= int(lengths[0])


def head(path: str, *lines: str, version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\n" + "".join(line + "\r\n" for line in lines) + "\r\n").encode()


def status_and_error(answer: bytes) -> tuple[int, dict]:
    """The status and error object of one answer (read to its close or `exchange`'s timeout: a refused body's
    connection stays open while aiohttp reads and drops what the client still sends, up to 10 s)."""
    status_line, _, rest = answer.removesuffix(b"<still open>").partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)["error"]


async def test_nesting_just_within_the_parsers_reach_is_a_400_not_a_500(tmp_path: Path) -> None:
    """A body nested a little less deeply than the parser refuses still parses, and rendering it for the
    prefix hashes recursed past the limit: a 500 at one or two depths near 975."""
    async with gateway(tmp_path, num_replicas=1) as gw:
        statuses = {}
        for depth in range(700, 1100):
            content = "[" * depth + "]" * depth
            body = ('{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": ' + content + "}]}")
            status, _, text = await gw.post("/v1/chat/completions", body.encode())
            statuses[depth] = status
            if status == 400:
                assert json.loads(text)["error"]["code"] == "invalid_json", text
        assert set(statuses.values()) <= {200, 400}, statuses
        assert statuses[700] == 200 and statuses[1099] == 400


async def test_a_body_that_does_not_decode_is_a_400(tmp_path: Path, caplog) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        for encoding in ("gzip", "deflate", "br"):
            status, headers, text = await gw.post("/v1/chat/completions", CHAT, {"Content-Encoding": encoding})
            assert status == 400, (encoding, text)
            assert json.loads(text)["error"]["code"] == "invalid_body"
    # Answered, not an error of the gateway's: no ERROR (with a traceback) per such request in its log.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-500:]


async def test_a_body_over_the_limit_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    """Content-Length says it: 413 at once, not a 100 Continue and a wait for 9 MiB."""
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(max_body_bytes=4096)) as gw:
        answer = await exchange(gw.url, head("/v1/chat/completions", "Content-Length: 9437184",
                                             "Expect: 100-continue"), timeout_s=10.0, answer_only=True)
        assert not answer.startswith(b"HTTP/1.1 100"), answer[:80]
        status, error = status_and_error(answer)
        assert status == 413 and error["code"] == "request_too_large"
        answer = await exchange(gw.url, head("/v1/chat/completions", "Content-Length: 9437184"), timeout_s=10.0,
                                answer_only=True)
        assert status_and_error(answer)[0] == 413  # without Expect too: not after waiting for the body


async def test_a_body_that_stalls_gets_408_and_the_connection_closes(tmp_path: Path) -> None:
    settings = GatewaySettings(body_timeout_s=0.3)
    async with gateway(tmp_path, num_replicas=1, settings=settings) as gw:
        answer = await exchange(gw.url, head("/v1/chat/completions", "Content-Length: 100") + b'{"model": "m"',
                                timeout_s=10.0, answer_only=True)  # the 408 comes at 0.3 s
        status, error = status_and_error(answer)
        assert status == 408 and error["code"] == "body_timeout"
        assert b"\r\nConnection: close\r\n" in answer  # the rest of the body is not waited for
        # A chunked body whose second chunk is malformed once the handler reads: an answer, not a hang.
        answer = await exchange(gw.url, head("/v1/chat/completions", "Transfer-Encoding: chunked") + b'5\r\n{"mod\r\n',
                                then=b"zz\r\nabc\r\n0\r\n\r\n", after_s=0.1, timeout_s=10.0,
                                answer_only=True)
        assert answer.split(b" ")[1] in (b"400", b"408"), answer[:200]


async def test_an_idle_client_connection_is_closed_after_the_keepalive_timeout(tmp_path: Path) -> None:
    settings = GatewaySettings(keepalive_timeout_s=0.3)
    async with gateway(tmp_path, num_replicas=1, settings=settings) as gw:
        request = head("/v1/chat/completions", f"Content-Length: {len(CHAT)}", "Content-Type: application/json")
        answer = await exchange(gw.url, request + CHAT, timeout_s=3.0)
        assert answer.startswith(b"HTTP/1.1 200") and not answer.endswith(b"<still open>")
        idle = await exchange(gw.url, b"", timeout_s=3.0)  # connects and says nothing
        assert not idle.endswith(b"<still open>")


async def test_an_admin_token_that_is_not_utf8_is_a_401(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(admin_token="s3cret")) as gw:
        for path in ("/admin/stats", "/admin/history"):
            request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
            answer = await exchange(gw.url, request + b"Authorization: Bearer \xff\xfe\r\n\r\n")
            status, error = status_and_error(answer)
            assert status == 401 and error["code"] == "invalid_admin_token"


async def test_an_http_1_0_stream_ends_with_the_connection(tmp_path: Path) -> None:
    """HTTP/1.0 has no chunked framing: a stream's end is the connection's, even if the client asked to
    keep it alive."""
    async with gateway(tmp_path, num_replicas=1) as gw:
        body = json.dumps(chat("hello", stream=True)).encode()
        request = head("/v1/chat/completions", f"Content-Length: {len(body)}", "Connection: keep-alive",
                       version="1.0")
        answer = await exchange(gw.url, request + body, timeout_s=3.0)
        assert answer.startswith(b"HTTP/1.0 200") and b"data: [DONE]" in answer
        assert not answer.endswith(b"<still open>")


async def client_gone_count(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvgate_router_requests_total") and 'outcome="client_gone"' in line)


async def test_a_client_that_leaves_before_the_answer_is_counted_as_gone(tmp_path: Path) -> None:
    """Whether the replica has not answered, has sent the head of a non-streamed answer, or has opened a
    stream without its first event: the attempt's outcome is client_gone, once."""
    async def head_then_stall(request: web.Request) -> web.StreamResponse:
        stream = request.path.endswith("/completions") and not request.path.endswith("chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        if not stream:
            response.content_length = 1000
        await response.prepare(request)
        if not stream:
            await response.write(b'{"id": "x", ')
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.05)  # until the gateway drops the attempt
        return response

    request = head("/v1/chat/completions", f"Content-Length: {len(CHAT)}", "Content-Type: application/json")
    async with gateway(tmp_path, num_replicas=1) as gw:  # a replica that has not answered
        await gw.fail(gw.sims[0], mode="slow_first_byte", slow_first_byte_s=30.0)
        await exchange(gw.url, request + CHAT, timeout_s=0.3)
        await eventually(lambda: client_gone_count(gw.url), "the attempt counted as client_gone")
        assert await client_gone_count(gw.url) == 1
    async with hand_written_replica(chat_completions=head_then_stall, completions=head_then_stall) as url:
        async with gateway(tmp_path, num_replicas=0, other_urls=(url,)) as gw:
            await exchange(gw.url, request + CHAT, timeout_s=0.3)  # the head of a non-streamed answer came
            completion = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}).encode()
            await exchange(gw.url, head("/v1/completions", f"Content-Length: {len(completion)}") + completion,
                           timeout_s=0.3)  # a stream opened, no event yet

            async def both_counted() -> bool:
                return await client_gone_count(gw.url) >= 2
            await eventually(both_counted, "both attempts counted as client_gone")
            assert await client_gone_count(gw.url) == 2


async def test_a_large_body_is_read_off_the_loop_with_the_same_answers(tmp_path: Path, monkeypatch) -> None:
    """Parsing, validating and hashing 8 MB of token ids take ~0.7 s of CPU: bodies from
    `handlers.OFF_LOOP_MIN_BYTES` up run on a worker thread, with the same answers and errors as on the loop.
    (The threshold is lowered here: the simulated replica takes at most 1 MiB.)"""
    monkeypatch.setattr(handlers, "OFF_LOOP_MIN_BYTES", 64 << 10)
    threads = []

    def build_route_request(*args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread() is threading.main_thread())
        return real_build(*args, **kwargs)

    real_build = handlers.build_route_request
    monkeypatch.setattr(handlers, "build_route_request", build_route_request)
    async with gateway(tmp_path, num_replicas=1) as gw:
        ids = [7] * 40_000  # ~120 KB of JSON
        body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
        assert len(body) > handlers.OFF_LOOP_MIN_BYTES
        status, _, text = await gw.post("/v1/completions", body)
        assert status == 200, text[:300]
        status, _, text = await gw.post("/v1/completions", json.dumps({"model": "m", "prompt": "hi"}).encode())
        assert status == 200, text[:300]
        assert threads == [False, True]  # the large body on a worker thread, the small one on the loop
        for bad, code in ((ids + ["x"], "invalid_type"), (ids + [float("nan")], "invalid_json")):
            body = json.dumps({"model": "m", "prompt": bad, "max_tokens": 1}).encode()
            status, _, text = await gw.post("/v1/completions", body)
            assert status == 400 and json.loads(text)["error"]["code"] == code, text[:300]
