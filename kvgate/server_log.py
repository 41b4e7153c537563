"""`MalformedRequestLog`: what an aiohttp server logs about requests that do not parse, one line per kind per
interval instead of an ERROR traceback per request.

aiohttp answers a request it cannot parse (a garbage request line, a header line over 8 KiB, a bad
Content-Length, TLS sent to the HTTP port) with 400 and logs "Error handling request" with the parser's
traceback, whose message quotes the offending bytes: a header line, `Authorization: Bearer <key>` and all. A
scanner or a fuzz then writes thousands of lines (the probe of issue 27 counted 430), and keys into the log.

The server's `logger` argument (`web.AppRunner(app, logger=...)`, handed to every connection's handler) is
the hook: this adapter takes the place of aiohttp's `aiohttp.server` logger, turns a parse error into one
WARNING line per error class per `LogLimiter` interval, naming the class, the status and the peer, never the
bytes, and passes everything else (a handler's unexpected error, debug lines) through unchanged. A shared leaf:
the gateway (`router.app.gateway_runner`) and the engine (`engine.server.main`) each build their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from kvgate.log_limit import DEFAULT_INTERVAL_S, LogLimiter


class MalformedRequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger for aiohttp's request handlers that limits parse errors; `now` is the owner's clock."""

    def __init__(self, logger: logging.Logger, now: Callable[[], float],
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__(logger, {})
        self._now = now
        self._limiter = LogLimiter(interval_s, max_keys=64)  # keys are aiohttp's error classes: about ten

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if not isinstance(exc, HttpProcessingError):
            super().log(level, msg, *args, **kwargs)
            return
        # aiohttp's message is "Error handling request from %s" with the peer as its one argument. It says debug
        # for what it deems scanner noise (a bad method as a connection's first bytes): kept so, and not counted.
        peer, kind, status = (args[0] if args else "?"), type(exc).__name__, exc.code or 400
        message = "malformed HTTP request from %s: %s, answered %s"
        if level < logging.WARNING:
            super().log(level, message, peer, kind, status)
            return
        verdict = self._limiter.hit(kind, self._now())
        if verdict is not None:
            super().log(logging.WARNING, message + "%s", peer, kind, status, verdict.note)
