"""Errors the gateway sends to clients, as OpenAI error objects (DESIGN.md "Conventions").

The error class and its rendering are the engine's too (`kvgate.openai_wire`); here are the gateway's own
refusals. Handlers and the proxy raise `ApiError`; the edge renders it once with `error_response`.

    {"error": {"message": "...", "type": "NotFoundError", "param": "model", "code": "model_not_found"}}
"""

from __future__ import annotations

import json

from kvgate.openai_wire import ApiError


def model_not_found(name: str, served: list[str]) -> ApiError:
    """404 listing the servable names: model and adapter names only, which `/v1/models` shows anyway."""
    shown = ", ".join(served[:50]) or "(none)"
    return ApiError(404, f"The model '{name}' does not exist; this gateway serves: {shown}",
                        type="NotFoundError", param="model", code="model_not_found")


def no_capacity(message: str, retry_after_s: float, code: str = "no_capacity") -> ApiError:
    return ApiError(503, message, type="ServiceUnavailableError", code=code,
                        headers={"Retry-After": str(max(1, round(retry_after_s)))})


def upstream_timeout(message: str) -> ApiError:
    return ApiError(504, message, type="GatewayTimeoutError", code="upstream_timeout")


def bad_gateway(message: str) -> ApiError:
    return ApiError(502, message, type="BadApiError", code="upstream_unavailable")


def sse_error_event(message: str, code: str) -> bytes:
    """The end of a stream that broke mid-way: an SSE error event, then `[DONE]`, so every OpenAI
    client stops reading (the official SDK raises an APIError on the error event)."""
    error = {"error": {"message": message, "type": "APIError", "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
