"""Errors the gateway sends to clients, as OpenAI error objects (DESIGN.md "Conventions").

The shape is the engine's (`engine.server.protocol.ApiError`), copied rather than imported: the router
never imports the engine. Handlers and the proxy raise `GatewayError`; the edge renders it once.

    {"error": {"message": "...", "type": "NotFoundError", "param": "model", "code": "model_not_found"}}
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class GatewayError(Exception):
    """A request the gateway refuses or cannot serve, carrying everything the error object needs."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.close = close  # no keep-alive after the answer (aiohttp may still read an unread body for up to 10 s)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, type="BadRequestError", param=param, code=code)


def model_not_found(name: str, served: list[str]) -> GatewayError:
    """404 listing the servable names: model and adapter names only, which `/v1/models` shows anyway."""
    shown = ", ".join(served[:50]) or "(none)"
    return GatewayError(404, f"The model '{name}' does not exist; this gateway serves: {shown}",
                        type="NotFoundError", param="model", code="model_not_found")


def no_capacity(message: str, retry_after_s: float, code: str = "no_capacity") -> GatewayError:
    return GatewayError(503, message, type="ServiceUnavailableError", code=code,
                        headers={"Retry-After": str(max(1, round(retry_after_s)))})


def upstream_timeout(message: str) -> GatewayError:
    return GatewayError(504, message, type="GatewayTimeoutError", code="upstream_timeout")


def bad_gateway(message: str) -> GatewayError:
    return GatewayError(502, message, type="BadGatewayError", code="upstream_unavailable")


def error_response(error: GatewayError) -> web.Response:
    response = web.json_response(error.body(), status=error.status, headers=error.headers)
    if error.close:
        response.force_close()
    return response


def sse_error_event(message: str, code: str) -> bytes:
    """The end of a stream that broke mid-way: an SSE error event, then `[DONE]`, so every OpenAI
    client stops reading (the official SDK raises an APIError on the error event)."""
    error = {"error": {"message": message, "type": "APIError", "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
