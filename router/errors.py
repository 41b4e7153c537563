"""Errors the gateway sends to clients, as OpenAI error objects (DESIGN.md "Conventions").

The error class and its rendering are the engine's too (`kvgate.openai_wire`); here are the gateway's own
refusals. Handlers and the proxy raise `GatewayError`; the edge renders it once with `error_response`.

    {"error": {"message": "...", "type": "NotFoundError", "param": "model", "code": "model_not_found"}}
"""

from __future__ import annotations

import json

from kvgate.openai_wire import ApiError, bad_request, error_response

__all__ = ["GatewayError", "bad_request", "error_response", "model_not_found", "no_capacity", "upstream_timeout",
           "bad_gateway", "sse_error_event"]

# The gateway's name for the shared error class: one class, so an error means the same on both hops.
GatewayError = ApiError


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


def sse_error_event(message: str, code: str) -> bytes:
    """The end of a stream that broke mid-way: an SSE error event, then `[DONE]`, so every OpenAI
    client stops reading (the official SDK raises an APIError on the error event)."""
    error = {"error": {"message": message, "type": "APIError", "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
