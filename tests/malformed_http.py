"""Requests that do not parse as HTTP, sent on a raw socket, as a scanner or a fuzz sends them; for the tests that
count what a server logs about them (the gateway's and the engine's)."""

from __future__ import annotations

import asyncio
import itertools

SECRET = "sk-do-not-log-0123456789"  # a client's key, in the headers of some of them

MALFORMED = (
    b"GARBAGE\r\n\r\n",  # no method, path or version
    b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SECRET.encode() + b"\r\nX-Big: " + b"a" * 20_000
    + b"\r\n\r\n",  # a header line over aiohttp's 8 KiB limit
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Key: " + SECRET.encode() + b"\x01\r\n\r\n",  # a control character in a value
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBearer " + SECRET.encode() + b"\r\n\r\n",  # a header line without a colon
    b"GET / HTTP/9.9\r\n\r\n",
)


async def send_raw(host: str, port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send `data` on a new connection and return all the server answered before it closed."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    except ConnectionResetError:  # it answered and closed before reading all of an oversized header
        return b""
    finally:
        writer.close()


async def send_malformed(host: str, port: int, count: int) -> list[bytes]:
    """`count` malformed requests, each on its own connection, cycling through `MALFORMED`; their status lines."""
    answers = [await send_raw(host, port, data) for data in itertools.islice(itertools.cycle(MALFORMED), count)]
    return [answer.split(b"\r\n", 1)[0] for answer in answers]
