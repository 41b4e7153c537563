"""The proxy's upstream HTTP/1.1 client (`router.upstream`) against real sockets.

Each test starts a raw asyncio server that answers with exactly the bytes the case needs (framing, early
closes, stalls), so what is checked is the client's reading of the wire, not another HTTP library's. Every
test runs on asyncio's loop and on uvloop, which the gateway runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from kvgate.router.upstream import Interrupt, ReplicaUnresponsive, UpstreamError, UpstreamPool
from tests.services import free_loopback_port

pytestmark = pytest.mark.timeout(30)

LONG_S = 5.0  # a timeout the test must not reach
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def on_both_loops(test: Callable[[], Awaitable[None]]) -> Callable[[str], None]:
    """Runs an async test once on asyncio's loop and once on uvloop's (their transports differ)."""
    def run(loop: str) -> None:
        (uvloop.run if loop == "uvloop" else asyncio.run)(test())
    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return pytest.mark.parametrize("loop", ["asyncio", "uvloop"])(run)


@dataclass
class Server:
    url: str
    num_connections: int = 0
    requests: list[bytes] = field(default_factory=list)  # each request's head, as received
    bodies: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a client closed a connection


@contextlib.asynccontextmanager
async def serving(answer: Handler) -> AsyncIterator[Server]:
    """A server on a free port; `answer(reader, writer)` runs once per request, after its head and body
    are read into the Server record. It returns to read the next request on the same connection."""
    port = free_loopback_port()
    server = Server(url=f"http://127.0.0.1:{port}")

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                server.requests.append(head)
                server.bodies.append(await reader.readexactly(length))
                await answer(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            server.closed.set()
        finally:
            writer.close()

    listener = await asyncio.start_server(on_connection, "127.0.0.1", port)
    try:
        yield server
    finally:
        listener.close()


@contextlib.asynccontextmanager
async def pooled(**knobs: float) -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool(**knobs)
    try:
        yield pool
    finally:
        await pool.close()


def answering(*parts: bytes, pause_s: float = 0.0, then_close: bool = False) -> Handler:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i, part in enumerate(parts):
            if i and pause_s:
                await asyncio.sleep(pause_s)
            writer.write(part)
            await writer.drain()
        if then_close:
            writer.close()
            raise ConnectionResetError  # stop serving this connection
    return answer


def json_answer(body: bytes, status: str = "200 OK") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def post(pool: UpstreamPool, url: str, body: bytes = b'{"model": "m"}', timeout_s: float = LONG_S):
    return await pool.post(url, "/v1/chat/completions", body, accept="text/event-stream",
                           connect_timeout_s=LONG_S, timeout_s=timeout_s)


async def post_and_read(pool: UpstreamPool, url: str) -> bytes:
    """One request's whole answer body; the response is released (its connection back to the pool if whole)."""
    response = await post(pool, url)
    try:
        return await response.read_all(LONG_S)
    finally:
        response.release()


@on_both_loops
async def test_a_sized_answer_is_read_whole_and_its_connection_serves_the_next_request() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b'{"ok": 1}'))) as server:
            for _ in range(3):
                response = await post(pool, server.url)
                assert (response.status, response.content_type) == (200, "application/json")
                assert await response.read_all(LONG_S) == b'{"ok": 1}'
                assert response.at_eof
                response.release()
            assert server.num_connections == 1
            assert server.bodies == [b'{"model": "m"}'] * 3


@on_both_loops
async def test_the_request_carries_the_base_urls_path_host_and_the_clients_accept() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            response = await pool.post(server.url + "/prefix", "/v1/completions", b"{}", accept="text/event-stream",
                                       connect_timeout_s=LONG_S, timeout_s=LONG_S)
            response.release()
            head = server.requests[0].decode()
            assert head.startswith("POST /prefix/v1/completions HTTP/1.1\r\n")
            assert f"Host: {server.url.removeprefix('http://')}\r\n" in head
            assert "Accept: text/event-stream\r\n" in head and "Content-Type: application/json\r\n" in head


@on_both_loops
async def test_the_base_urls_query_string_follows_the_path() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            response = await post(pool, server.url + "/openai?api-version=2024-06-01")
            response.release()
            target = b"/openai/v1/chat/completions?api-version=2024-06-01"
            assert server.requests[0].startswith(b"POST " + target + b" HTTP/1.1\r\n")


@on_both_loops
async def test_a_chunked_stream_is_read_as_it_arrives_without_its_framing() -> None:
    async with pooled() as pool:
        events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
        parts = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n"]
        parts += [f"{len(event):x}\r\n".encode() + event + b"\r\n" for event in events] + [b"0\r\n\r\n"]
        async with serving(answering(*parts, pause_s=0.05)) as server:
            response = await post(pool, server.url)
            assert response.content_type == "text/event-stream"
            received = []
            while chunk := await response.read(LONG_S):
                received.append(chunk)
            assert received == events  # one read per event: each was sent 50 ms after the last
            response.release()
            response = await post(pool, server.url)  # the same connection again
            assert await response.read_all(LONG_S) == b"".join(events)
            response.release()
            assert server.num_connections == 1


@on_both_loops
async def test_a_body_that_runs_to_the_close_ends_there_and_its_connection_is_not_reused() -> None:
    async with pooled() as pool:
        answer = answering(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"all of it", then_close=True)
        async with serving(answer) as server:
            assert [await post_and_read(pool, server.url) for _ in range(2)] == [b"all of it"] * 2
            assert server.num_connections == 2


@on_both_loops
async def test_a_body_cut_short_by_the_close_is_an_error_not_an_end() -> None:
    async with pooled() as pool:
        answer = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"only part", then_close=True)
        async with serving(answer) as server:
            response = await post(pool, server.url)
            with pytest.raises(UpstreamError, match="in the middle of the body"):
                await response.read_all(LONG_S)
            assert not response.at_eof
            response.close()


@on_both_loops
async def test_a_connection_closed_before_the_answer_is_an_error() -> None:
    async with pooled() as pool:
        async with serving(answering(then_close=True)) as server:
            with pytest.raises(UpstreamError, match="before answering"):
                await post(pool, server.url)


@on_both_loops
async def test_a_refused_connection_is_an_error() -> None:
    async with pooled() as pool:
        with pytest.raises(UpstreamError, match="cannot connect"):
            await post(pool, f"http://127.0.0.1:{free_loopback_port()}")


@on_both_loops
async def test_an_answer_that_is_not_http_is_an_error() -> None:
    async with pooled() as pool:
        async with serving(answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as server:
            with pytest.raises(UpstreamError, match="not valid HTTP"):
                await post(pool, server.url)


@on_both_loops
async def test_headers_that_come_late_time_out() -> None:
    async with pooled() as pool:
        async with serving(answering(b"", json_answer(b"{}"), pause_s=LONG_S)) as server:
            with pytest.raises(TimeoutError):
                await post(pool, server.url, timeout_s=0.1)


@on_both_loops
async def test_a_body_that_goes_silent_times_out() -> None:
    async with pooled() as pool:
        late = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"late!", pause_s=LONG_S)
        async with serving(late) as server:
            response = await post(pool, server.url)
            with pytest.raises(TimeoutError):
                await response.read(0.1)
            response.close()


@on_both_loops
async def test_closing_a_response_mid_body_closes_the_connection_the_replica_sees() -> None:
    async with pooled() as pool:
        answer = answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")

        async def answer_then_wait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await answer(reader, writer)
            await reader.read()  # returns at the client's close
            raise ConnectionResetError

        async with serving(answer_then_wait) as server:
            response = await post(pool, server.url)
            assert await response.read(LONG_S) == b"first"
            response.close()
            await asyncio.wait_for(server.closed.wait(), LONG_S)


@on_both_loops
async def test_an_idle_connection_the_replica_closed_is_replaced_without_an_error() -> None:
    async with pooled() as pool:
        num_answered = 0

        async def answer_once_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal num_answered
            if num_answered == 1:  # the second request reaches the kept-alive connection: drop it unanswered,
                num_answered += 1  # as a server does that closes idle connections just as one is reused
                raise ConnectionResetError
            num_answered += 1
            writer.write(json_answer(b"{}"))
            await writer.drain()

        async with serving(answer_once_per_connection) as server:
            assert [await post_and_read(pool, server.url) for _ in range(2)] == [b"{}"] * 2
            assert server.num_connections == 2


@on_both_loops
async def test_interim_answers_are_skipped_and_the_final_one_is_read_whole() -> None:
    async with pooled() as pool:
        final = json_answer(b'{"answer": 1}')
        head, body = final.split(b"\r\n\r\n")
        answer = answering(b"HTTP/1.1 100 Continue\r\n\r\n" + b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n",
                           head + b"\r\n\r\n", body, pause_s=0.05)
        async with serving(answer) as server:
            for _ in range(2):  # and the connection, reused, carries the next request's own answer
                response = await post(pool, server.url)
                assert (response.status, response.content_type) == (200, "application/json")
                assert "link" not in response.headers
                assert await response.read_all(LONG_S) == b'{"answer": 1}'
                response.release()
            assert server.num_connections == 1


@on_both_loops
async def test_a_second_answer_to_one_request_is_an_error_not_more_body() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"first") + json_answer(b"second"))) as server:
            with pytest.raises(UpstreamError, match="second answer"):  # in one segment: seen with the head
                response = await post(pool, server.url)
                await response.read_all(LONG_S)


@on_both_loops
async def test_switching_protocols_unasked_is_an_error() -> None:
    async with pooled() as pool:
        async with serving(answering(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n")
                           ) as server:
            with pytest.raises(UpstreamError, match="switched protocols"):
                await post(pool, server.url)


@on_both_loops
async def test_trailers_do_not_replace_the_heads_headers() -> None:
    async with pooled() as pool:
        answer = answering(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                           b"Trailer: Content-Type\r\n\r\n2\r\n{}\r\n0\r\nContent-Type: text/evil\r\n\r\n")
        async with serving(answer) as server:
            response = await post(pool, server.url)
            assert await response.read_all(LONG_S) == b"{}"
            assert response.content_type == "application/json"
            response.release()


@on_both_loops
async def test_a_body_running_to_the_close_that_ends_in_a_reset_is_broken() -> None:
    async with pooled() as pool:
        head_read = asyncio.Event()  # a reset before the client read the head would lose it with the head

        async def reset_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial")
            await writer.drain()
            await head_read.wait()
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            writer.transport.abort()
            raise ConnectionResetError

        async with serving(reset_mid_body) as server:
            response = await post(pool, server.url)
            head_read.set()
            with pytest.raises(UpstreamError, match="middle of the body"):
                await response.read_all(LONG_S)
            response.close()


@on_both_loops
async def test_a_reused_connection_dropped_after_the_replica_had_the_request_is_not_resent() -> None:
    async with pooled() as pool:
        num_answered = 0

        async def answer_then_drop_slowly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal num_answered
            num_answered += 1
            if num_answered == 2:  # it had the request for 300 ms: it may have started on it
                await asyncio.sleep(0.3)
                raise ConnectionResetError
            writer.write(json_answer(b"{}"))
            await writer.drain()

        async with serving(answer_then_drop_slowly) as server:
            await post_and_read(pool, server.url)
            with pytest.raises(UpstreamError, match="before answering"):
                await post(pool, server.url)
            assert len(server.bodies) == 2  # sent once each, never again


@on_both_loops
async def test_a_connection_idle_past_max_idle_s_is_not_reused() -> None:
    async with pooled(max_idle_s=0.1) as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            for pause_s in (0.0, 0.3):
                await asyncio.sleep(pause_s)
                await post_and_read(pool, server.url)
            assert server.num_connections == 2


@on_both_loops
async def test_a_stale_idle_connection_to_a_replica_that_gets_no_more_requests_is_closed() -> None:
    """A replica that vanished without closing its connections gets no more requests; traffic to the others
    sweeps its stale idle sockets shut instead of keeping them open for good. (These servers never close an
    idle connection, as a vanished host never does.)"""
    async with pooled(max_idle_s=0.1) as pool:
        async with serving(answering(json_answer(b"{}"))) as gone, serving(answering(json_answer(b"{}"))) as other:
            await post_and_read(pool, gone.url)
            await asyncio.sleep(0.3)
            assert not gone.closed.is_set()
            await post_and_read(pool, other.url)  # its release sweeps
            await asyncio.wait_for(gone.closed.wait(), LONG_S)
            assert not other.closed.is_set()  # just released: not stale


@on_both_loops
async def test_a_head_that_never_ends_is_an_error_before_the_timeout() -> None:
    async def endless_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        with contextlib.suppress(ConnectionError):
            while True:  # headers without end, until the client hangs up
                writer.write(b"X-Pad: " + b"a" * 1000 + b"\r\n")
                await writer.drain()
        raise ConnectionResetError

    async with pooled() as pool:
        async with serving(endless_headers) as server:
            with pytest.raises(UpstreamError, match="no end of headers"):
                await asyncio.wait_for(post(pool, server.url), LONG_S)


@on_both_loops
async def test_an_authorization_value_goes_as_the_header_and_one_with_a_line_break_never_does() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            response = await pool.post(server.url, "/v1/chat/completions", b"{}", authorization="Bearer k1",
                                       connect_timeout_s=LONG_S, timeout_s=LONG_S)
            await response.read_all(LONG_S)
            response.release()
            assert b"\r\nAuthorization: Bearer k1\r\n" in server.requests[0]
            with pytest.raises(UpstreamError, match="not printable ASCII"):
                await pool.post(server.url, "/x", b"{}", authorization="Bearer k1\r\nX-Evil: 1",
                                connect_timeout_s=LONG_S, timeout_s=LONG_S)
            assert len(server.requests) == 1


@on_both_loops
async def test_an_accept_header_that_is_not_printable_ascii_becomes_any() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            for accept in ("text/\u20ac", "text/\udce9"):  # a euro sign; a byte aiohttp decoded by surrogateescape
                response = await pool.post(server.url, "/v1/completions", b"{}", accept=accept,
                                           connect_timeout_s=LONG_S, timeout_s=LONG_S)
                response.close()
            assert all(b"Accept: */*\r\n" in head for head in server.requests)


@on_both_loops
async def test_credentials_in_the_base_url_go_as_basic_auth() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            url = server.url.replace("http://", "http://kv%40gate:s3cret@")
            response = await post(pool, url)
            response.release()
            head = server.requests[0].decode()
            assert "Authorization: Basic a3ZAZ2F0ZTpzM2NyZXQ=\r\n" in head  # base64 of "kv@gate:s3cret"
            assert f"Host: {server.url.removeprefix('http://')}\r\n" in head


@on_both_loops
async def test_a_reader_that_falls_behind_stops_the_replicas_stream_instead_of_buffering_it() -> None:
    async with pooled() as pool:
        size = 32 * 1024 * 1024  # far more than loopback's socket buffers hold
        writers: list[asyncio.StreamWriter] = []

        async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode() + b"x" * size)
            await writer.drain()

        async with serving(big) as server:
            response = await post(pool, server.url)
            await asyncio.sleep(0.5)  # read nothing: the client must stop reading the socket
            assert writers[0].transport.get_write_buffer_size() > size // 2
            assert len(await response.read_all(LONG_S)) == size
            response.release()


def waiting_for_the_close(answer: Handler) -> Handler:
    """`answer`, then hold the connection open until the client closes it."""
    async def then_wait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer(reader, writer)
        await reader.read()  # returns at the client's close
        raise ConnectionResetError
    return then_wait


@on_both_loops
async def test_an_interrupt_ends_the_wait_for_a_head_at_once_and_closes_the_connection() -> None:
    async with pooled() as pool:
        async with serving(waiting_for_the_close(answering())) as server:  # a replica that never answers
            interrupt = Interrupt()
            exchange = asyncio.ensure_future(pool.post(server.url, "/v1/chat/completions", b"{}",
                                                       connect_timeout_s=LONG_S, timeout_s=LONG_S, interrupt=interrupt))
            await asyncio.sleep(0.1)
            interrupt.fire()
            with pytest.raises(ReplicaUnresponsive):
                await asyncio.wait_for(exchange, 1.0)  # far before its 5 s timeout
            await asyncio.wait_for(server.closed.wait(), LONG_S)  # the replica sees its client go


@on_both_loops
async def test_an_interrupt_ends_the_wait_for_body_bytes_and_every_read_after() -> None:
    async with pooled() as pool:
        answer = answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        async with serving(waiting_for_the_close(answer)) as server:
            interrupt = Interrupt()
            response = await pool.post(server.url, "/v1/chat/completions", b"{}", connect_timeout_s=LONG_S,
                                       timeout_s=LONG_S, interrupt=interrupt)
            assert await response.read(LONG_S) == b"first"
            read = asyncio.ensure_future(response.read(LONG_S))
            await asyncio.sleep(0.1)
            interrupt.fire()
            with pytest.raises(ReplicaUnresponsive):
                await asyncio.wait_for(read, 1.0)
            with pytest.raises(ReplicaUnresponsive):
                await response.read(LONG_S)
            response.close()
            await asyncio.wait_for(server.closed.wait(), LONG_S)


@on_both_loops
async def test_an_interrupt_if_silent_spares_an_exchange_that_still_hears_from_its_replica() -> None:
    async def trickling(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(8):  # a byte every 0.1 s, then silence
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        await reader.read()
        raise ConnectionResetError

    async with pooled() as pool, serving(trickling) as server:
        interrupt = Interrupt()
        response = await pool.post(server.url, "/v1/chat/completions", b"{}", connect_timeout_s=LONG_S,
                                   timeout_s=LONG_S, interrupt=interrupt)
        received = b""
        while len(received) < 8:
            received += await response.read(LONG_S)
            assert not interrupt.fire_if_silent(0.3)  # heard from it within the last 0.3 s: spared
        read = asyncio.ensure_future(response.read(LONG_S))
        await asyncio.sleep(0.4)
        assert interrupt.fire_if_silent(0.3)  # silent for 0.3 s: given up on
        with pytest.raises(ReplicaUnresponsive):
            await asyncio.wait_for(read, 1.0)
        response.close()


@on_both_loops
async def test_an_interrupt_fired_before_the_exchange_fails_it_as_it_starts() -> None:
    async with pooled() as pool:
        async with serving(answering(json_answer(b"{}"))) as server:
            interrupt = Interrupt()
            interrupt.fire()
            with pytest.raises(ReplicaUnresponsive):
                await pool.post(server.url, "/v1/chat/completions", b"{}", connect_timeout_s=LONG_S,
                                timeout_s=LONG_S, interrupt=interrupt)


@on_both_loops
async def test_an_interrupt_fired_after_its_exchange_released_the_connection_spares_the_next_request() -> None:
    # The connection goes back to the pool when the first answer is read; a late "stop" meant for the first
    # request must not fail the second, which reuses the same connection.
    async with pooled() as pool:
        answer = json_answer(b"{}")
        async with serving(answering(answer[:-2], answer[-2:], pause_s=0.2)) as server:  # the body a bit later
            interrupt = Interrupt()
            first = await pool.post(server.url, "/v1/chat/completions", b"{}", connect_timeout_s=LONG_S,
                                    timeout_s=LONG_S, interrupt=interrupt)
            assert await first.read_all(LONG_S) == b"{}"
            first.release()
            second = await pool.post(server.url, "/v1/chat/completions", b"{}", connect_timeout_s=LONG_S,
                                     timeout_s=LONG_S)
            interrupt.fire()
            assert await second.read_all(LONG_S) == b"{}"
            assert server.num_connections == 1  # the second request did reuse the first's connection
