"""The proxy's HTTP/1.1 client to replicas: one POST per attempt over kept-alive connections, the answer's
body read as it arrives.

Why not aiohttp's client: the proxy needs one kind of call, and aiohttp's general client (request and
response objects, URL objects, cookie jar, connector bookkeeping, a timeout context per read) cost 22% of
the gateway's CPU per streamed request in `loadtests/bench_gateway_overhead.py`'s profile, about as much as
routing, parsing and relaying together. This client writes the request head as one string, parses the answer
with llhttp (`httptools`, the parser uvicorn uses), and arms each read's timeout as one timer on the loop.

Contract:
- `UpstreamPool.post` connects (or takes a connection to the same scheme, host and port that has been idle
  under 4 s), sends the request and returns once the final status line and headers are in (1xx interim
  answers are skipped). It raises `UpstreamError` when the connection fails or closes before the headers, and
  `TimeoutError` when they take longer than `timeout_s`. A reused connection that closes within 100 ms,
  before any byte of an answer, is the server's idle close: the request goes once more, on a fresh
  connection. Credentials in the base URL (`http://user:password@host`) go as Basic auth.
- An `Interrupt` given to `post` ends the exchange from outside (the replica stopped answering its health
  checks): its wait for the head or for body bytes raises `ReplicaUnresponsive` at once, and the connection closes.
  `fire_if_silent(s)` does so only to an exchange that heard nothing from its replica for `s` seconds (no byte
  since the request went, none waiting to be read): a replica that is still delivering is never cut off.
- `UpstreamResponse.read(timeout_s)` returns the body bytes that have arrived (chunked framing removed),
  waiting up to `timeout_s` for some; b"" once the body is complete. A body that breaks raises `UpstreamError`.
- Every response ends with `release()` (a complete body: the connection goes back to the pool when the
  server keeps it alive) or `close()` (anything else: the connection closes, which is how a replica learns
  that the request was abandoned). Both are idempotent.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

from kvgate.router.membership import public_url

# Body bytes buffered per connection before reading from the replica pauses until the proxy catches up:
# a slow client slows the replica's stream instead of growing the gateway's memory.
_READ_BUFFER_BYTES = 64 * 1024
# Idle kept-alive connections kept per replica; more are closed on release. A few thousand concurrent
# streams over a handful of replicas fit.
_MAX_IDLE_PER_ORIGIN = 1024
# An idle connection is not reused after this long: uvicorn (under vLLM and SGLang) closes connections idle
# for 5 s, and reusing one just as the server closes it loses the request.
_MAX_IDLE_S = 4.0
# Bytes that may arrive before an answer's head is complete: real heads take a few hundred, and the read that
# ends one may carry up to _READ_BUFFER_BYTES of body. Past it the replica is not answering HTTP.
_MAX_HEAD_BYTES = 1 << 20
# Parsed replica URLs kept; past this many the cache starts over (a fleet's replicas, many times over).
_MAX_TARGETS = 4096
# A reused connection that closes this soon after the request went out, before any byte of an answer, was
# closed by the server as it sat idle: the request gets one fresh connection to the same replica. Later, the
# replica may have started on it, and the proxy's retry (elsewhere) decides.
_STALE_CLOSE_WINDOW_S = 0.1


class UpstreamError(Exception):
    """The connection to a replica failed, closed early or carried something that is not HTTP/1.1."""


class _ClosedUnanswered(UpstreamError):
    """The replica closed the connection before any byte of an answer."""


class ReplicaUnresponsive(UpstreamError):
    """The gateway gave up on the exchange: the replica stopped answering its health checks (`Interrupt`)."""


class Interrupt:
    """Gives up on one exchange from outside. After `fire`, the exchange's pending wait (for its head or body
    bytes) and every later one raise `ReplicaUnresponsive`, and its connection closes, which aborts the request
    at the replica; an exchange not yet sent fails as it starts. Idempotent. Costs nothing until fired: the
    connection's own waiter is woken, no task or timer per read."""

    def __init__(self) -> None:
        self._connection: _Connection | None = None
        self._fired = False

    def fire(self) -> None:
        self._fired = True
        if self._connection is not None:
            self._connection._fail(ReplicaUnresponsive("the replica stopped answering its health checks"))

    def fire_if_silent(self, silent_for_s: float) -> bool:
        """`fire`, where the exchange has heard nothing from its replica for `silent_for_s` seconds; whether it
        fired. An exchange still connecting has sent nothing to wait on: it is left to its connect timeout."""
        if self._connection is None or not self._connection.silent_for(silent_for_s):
            return False
        self.fire()
        return True

    def _attach(self, connection: _Connection) -> None:
        self._connection = connection
        if self._fired:
            self.fire()

    def _detach(self) -> None:
        self._connection = None


@dataclass(frozen=True)
class _Target:
    """Where a replica's base URL sends requests, parsed once per URL."""

    origin: tuple[str, str, int]  # (scheme, host, port): the pool's key
    path_prefix: str  # a base URL's own path ("http://h/api" -> "/api"), "" for most
    query: str  # a base URL's query string with its "?" ("http://h/api?v=1" -> "?v=1"), kept after the path
    fixed_headers: str  # Host, and Authorization when the URL carries user:password


class UpstreamPool:
    """Keep-alive connections to replicas, for the proxy's POSTs. One per gateway; close() at shutdown."""

    def __init__(self, max_idle_per_origin: int = _MAX_IDLE_PER_ORIGIN, max_idle_s: float = _MAX_IDLE_S) -> None:
        self._max_idle = max_idle_per_origin
        self._max_idle_s = max_idle_s
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = collections.defaultdict(
            collections.deque)
        self._targets: dict[str, _Target] = {}
        self._live: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._swept_at = 0.0  # loop time of the last sweep of stale idle connections (`_release`)

    async def post(self, base_url: str, path: str, body: bytes, *, accept: str = "*/*",
                   authorization: str | None = None, request_id: str | None = None, connect_timeout_s: float,
                   timeout_s: float, interrupt: Interrupt | None = None) -> UpstreamResponse:
        """POST `body` (JSON) to `base_url + path`, with `authorization` as the Authorization header and
        `request_id` as X-Request-Id when given; the response once its headers are in. Raises UpstreamError
        (ReplicaUnresponsive once `interrupt` fired, here or in the response's reads) or TimeoutError (connect:
        after min(connect_timeout_s, timeout_s); headers: timeout_s)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        target = self._target(base_url)
        if not header_safe(accept):  # the client's header: never CR/LF, never a 500
            accept = "*/*"
        extra_headers = ""
        if authorization is not None:
            if not header_safe(authorization):
                raise UpstreamError("the replica's Authorization value is not printable ASCII")
            extra_headers = f"Authorization: {authorization}\r\n"
        if request_id and header_safe(request_id):
            extra_headers += f"X-Request-Id: {request_id}\r\n"
        head = (f"POST {target.path_prefix}{path}{target.query} HTTP/1.1\r\n{target.fixed_headers}{extra_headers}"
                f"Content-Type: application/json\r\nAccept: {accept}\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode("latin-1")
        connection = self._take_idle(target.origin, loop.time())
        if connection is not None:
            sent_at = loop.time()
            try:
                return await self._exchange(connection, head, body, deadline, interrupt)
            except _ClosedUnanswered:
                if loop.time() - sent_at > _STALE_CLOSE_WINDOW_S:
                    raise
        connection = await self._connect(target.origin, min(connect_timeout_s, deadline - loop.time()))
        return await self._exchange(connection, head, body, deadline, interrupt)

    async def _exchange(self, connection: _Connection, head: bytes, body: bytes, deadline: float,
                        interrupt: Interrupt | None) -> UpstreamResponse:
        response = UpstreamResponse(self, connection, interrupt)
        try:
            connection.send(head, body)
            if interrupt is not None:
                interrupt._attach(connection)
            await connection.wait_head(deadline)
        except BaseException:
            response.close()
            raise
        return response

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        for connection in list(self._live):
            connection.close()
        self._idle.clear()

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            target = _parse_target(base_url)
            if len(self._targets) >= _MAX_TARGETS:  # replicas come and go: a parse cache, not a registry
                self._targets.clear()
            self._targets[base_url] = target
        return target

    def _take_idle(self, origin: tuple[str, str, int], now: float) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to have been closed by the server
            connection.idle_in = None
            if connection.reusable() and now - connection.idle_since <= self._max_idle_s:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: tuple[str, str, int], timeout_s: float) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(self, origin), host, port,
                                                                ssl=tls)
        except OSError as exc:  # refused, unreachable, reset, TLS failures (ssl.SSLError is one)
            raise UpstreamError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from exc
        return connection

    def _release(self, connection: _Connection) -> None:
        """A connection whose response is complete: idle for the next request, or closed."""
        origin = connection.origin
        idle = self._idle[origin]
        now = asyncio.get_running_loop().time()
        if connection.reusable() and len(idle) < self._max_idle:
            connection.idle_in = idle
            connection.idle_since = now
            idle.append(connection)
        else:
            connection.close()
        if now - self._swept_at > self._max_idle_s:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close every connection idle past max_idle_s (none would be reused), of every replica. A replica
        that vanished without closing its connections (a spot node reclaimed, a partition) gets no more
        requests, so `_take_idle` never meets them: without this its sockets stayed open for good, up to
        max_idle_per_origin of them per replica. Runs from `_release`, at most once per max_idle_s."""
        self._swept_at = now
        for origin, idle in list(self._idle.items()):
            while idle and now - idle[0].idle_since > self._max_idle_s:  # oldest first: released in order
                stale = idle.popleft()
                stale.idle_in = None
                stale.close()
            if not idle:
                del self._idle[origin]


def header_safe(value: str) -> bool:
    """Whether `value` may go into an HTTP head as a header value: printable ASCII, so never CR/LF."""
    return value.isascii() and value.isprintable()


def _parse_target(base_url: str) -> _Target:
    try:
        parts = urlsplit(base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host_header = parts.netloc.rpartition("@")[2]
        host_header.encode("ascii")
    except (ValueError, UnicodeError) as exc:  # its text may quote the user part: only its class
        raise UpstreamError(f"not a usable replica URL: {public_url(base_url)!r} ({type(exc).__name__})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) URL: {public_url(base_url)!r}")
    headers = f"Host: {host_header}\r\n"
    if parts.username is not None:  # http://user:password@host, as aiohttp's client sent it
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers += f"Authorization: Basic {base64.b64encode(credentials).decode()}\r\n"
    return _Target(origin=(parts.scheme, parts.hostname, port), path_prefix=parts.path.rstrip("/"),
                   query=f"?{parts.query}" if parts.query else "", fixed_headers=headers)


class UpstreamResponse:
    """One answer from a replica: `status`, `headers` (lower-case names), and the body through `read`."""

    def __init__(self, pool: UpstreamPool, connection: _Connection, interrupt: Interrupt | None = None) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self._interrupt = interrupt

    @property
    def status(self) -> int:
        return self._open().status

    @property
    def headers(self) -> dict[str, str]:
        """The final head's headers, names in lower case ("content-type")."""
        return self._open().headers

    @property
    def content_type(self) -> str:
        """The media type alone, lower case ("text/event-stream"), "" when the replica sent none."""
        return self._open().headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def at_eof(self) -> bool:
        """The whole body has arrived and been read."""
        connection = self._connection
        return connection is not None and connection.complete and not connection.body

    async def read(self, timeout_s: float) -> bytes:
        """Body bytes: what has arrived, or, when nothing has, the next to arrive within `timeout_s`
        (TimeoutError after). b"" once the body is complete; UpstreamError when it broke."""
        return await self._open().read(timeout_s)

    async def read_all(self, timeout_s: float) -> bytes:
        """The rest of the body, `timeout_s` allowed between arrivals."""
        parts = []
        while chunk := await self.read(timeout_s):
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with a complete body: the connection may serve another request. Otherwise the same as close()."""
        if not self.at_eof:
            self.close()
            return
        connection, self._connection = self._connection, None
        if self._interrupt is not None:
            self._interrupt._detach()  # the connection may serve another request now: never fail that one
        self._pool._release(connection)

    def close(self) -> None:
        """Done, whatever the state of the body: the connection closes (the replica sees its client go)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _open(self) -> _Connection:
        if self._connection is None:
            raise UpstreamError("the response was already released")
        return self._connection


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and its llhttp parser; holds at most one response at a time."""

    def __init__(self, pool: UpstreamPool, origin: tuple[str, str, int]) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = asyncio.get_running_loop()
        # The parser holds this connection's bound methods (its callbacks): a cycle, which `connection_lost`
        # breaks (None), so a closed connection is freed by reference counting. Left to the cyclic collector,
        # which the gateway runs once per GC_GEN0_THRESHOLD objects that outlive their request (`router.main`),
        # the connections the idle sweep closes (~5 KB each, one every few seconds at 35 req/s) piled up for
        # over an hour: ~2.5 MiB/h in loadtests/soak_gateway.py (docs/benchmarks.md).
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.idle_in: collections.deque[_Connection] | None = None  # the pool's idle list holding it
        self.idle_since = 0.0  # loop time it went idle
        self.heard_at = 0.0  # loop time of the last byte from the replica, or of the request sent after it
        self.error: UpstreamError | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False  # the final head (not a 1xx) is in
        self.complete = False
        self._interim = False  # inside a 1xx answer (100 Continue, 103 Early Hints): the real one follows
        self._answered = False  # some byte of an answer arrived
        self.keep_alive = False
        self._delimited = False  # the body has a length or chunked framing, so a close mid-way is a break
        self.body: list[bytes] = []
        self._num_body_bytes = 0
        self._num_head_bytes = 0  # bytes received while the final head was still coming

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self._pool._live.add(self)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self.complete or self.error is not None:  # nothing is owed: unusable now
            self._fail(UpstreamError("the replica sent bytes outside any response"))
            return
        self._answered = True
        self.heard_at = self._loop.time()
        if not self.head_done:
            self._num_head_bytes += len(data)
            if self._num_head_bytes > _MAX_HEAD_BYTES:
                self._fail(UpstreamError(f"the replica's answer has no end of headers in {_MAX_HEAD_BYTES} bytes"))
                return
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(UpstreamError(f"the replica's answer is not valid HTTP/1.1: {type(exc).__name__}: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool._live.discard(self)
        if self.idle_in is not None:
            try:
                self.idle_in.remove(self)
            except ValueError:
                pass
            self.idle_in = None
        if self.head_done and not self.complete and not self._delimited and exc is None and self.error is None:
            self.complete = True  # a body that runs until the connection closes has just ended
        elif not self.complete:
            reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
            where = "in the middle of the body" if self.head_done else "before answering"
            error = UpstreamError if self._answered else _ClosedUnanswered
            self._fail(error(f"the replica closed the connection {where}{reason}"), close=False)
        self._transport = None
        self._parser = None  # nothing more to parse: the cycle through its callbacks ends here
        self._wake()

    # -- llhttp callbacks

    def on_message_begin(self) -> None:
        if self.head_done:  # pipelining is never asked for: one request, one answer (after any 1xx)
            self._fail(UpstreamError("the replica sent a second answer to one request"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # trailers (after a chunked body) never replace the head's headers
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.error is not None:
            return
        parser = cast(httptools.HttpResponseParser, self._parser)  # a callback runs inside parser.feed_data
        status = parser.get_status_code()
        if status == 101:
            self._fail(UpstreamError("the replica switched protocols, which nothing asked for"))
            return
        if 100 <= status < 200:  # an interim answer: the final one follows on the same connection
            self._interim = True
            self.headers = {}
            return
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        headers = self.headers
        self._delimited = ("content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
                           or self.status in (204, 304))
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.error is not None:
            return
        self.body.append(body)
        self._num_body_bytes += len(body)
        if self._num_body_bytes > _READ_BUFFER_BYTES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self.error is None:
            self.complete = True
            self._wake()

    # -- used by the pool and the response

    def reusable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing() and self.error is None \
            and self.keep_alive

    def send(self, head: bytes, body: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise _ClosedUnanswered("the connection closed before the request was sent")
        self._reset()
        self.heard_at = self._loop.time()
        self._transport.write(head + body)

    def silent_for(self, silent_for_s: float) -> bool:
        """Nothing came from the replica for `silent_for_s` seconds and nothing waits to be read: bytes held
        back while a slow client catches up are the gateway's wait, not the replica's silence."""
        return not self.body and self._loop.time() - self.heard_at >= silent_for_s

    async def wait_head(self, deadline: float) -> None:
        """Until the final head is in; TimeoutError at `deadline` (loop time)."""
        while True:
            if self.error is not None:
                raise self.error
            if self.head_done:
                return
            await self._wait(deadline - self._loop.time())

    async def read(self, timeout_s: float) -> bytes:
        if not self.body and not self.complete and self.error is None:
            await self._wait(timeout_s)
        body = self.body
        if body:
            data = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            self._num_body_bytes = 0
            if self._paused and self._transport is not None:
                self._paused = False
                self._transport.resume_reading()
            return data
        if self.error is not None and not self.complete:
            raise self.error
        return b""

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, timeout_s: float) -> None:
        """Until the connection has news (headers, body, the end, an error); TimeoutError after `timeout_s`."""
        if timeout_s <= 0:
            raise TimeoutError
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError, close: bool = True) -> None:
        if self.error is None:
            self.error = error
        if close:
            self.close()
        self._wake()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
