"""The OpenAI wire shapes that the engine and the gateway both speak: the error object and JSON request bodies.

A shared leaf (it imports nothing of ours but `kvgate.tokenizer`'s strict JSON reader), so the engine and the
router, which may not import each other, raise and render the one `ApiError` and read bodies with the one
`parse_json_body`. Every refusal leaves as an OpenAI error object with its status (DESIGN.md "Conventions"):

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": "invalid_type"}}

What differs between the two servers is only wording that clients already see: each passes its own
`BodyWording`, so their 400s stay what they were while the checks behind them are written once.

Both also guard admin endpoints the same way: `require_bearer` (a constant-time Bearer check) and
`is_loopback_host` (whether a listening address is reachable from this machine only).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvgate.tokenizer import NotJsonText, loads_json_text, lone_surrogate_in


class ApiError(Exception):
    """A request a server refuses or cannot serve, carrying everything the OpenAI error object needs."""

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


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, type="BadRequestError", param=param, code=code)


def error_response(error: ApiError) -> web.Response:
    """The error as its HTTP answer: the error object as JSON, its status and headers."""
    response = web.json_response(error.body(), status=error.status, headers=error.headers)
    if error.close:
        response.force_close()
    return response


def bearer_credential(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` header (the scheme in any case, as RFC 7235 has
    it; spaces around the credential dropped), or None for any other header or none."""
    scheme, _, credential = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credential.strip() or None


def require_bearer(authorization: str | None, tokens: Iterable[str], *, name: str,
                   code: str = "invalid_admin_token") -> None:
    """Return when `authorization` (the header's value, None when absent) is `Bearer <one of tokens>` (see
    `bearer_credential`); raise
    ApiError 401 with `WWW-Authenticate: Bearer` otherwise, naming the token wanted as `name` and never its
    value. Each token is compared in constant time, and every one is compared, so the time taken does not say
    which came close. Header bytes that are not UTF-8 arrive as surrogate escapes and compare as the bytes they
    were. Empty tokens are ignored; with none left every caller is refused."""
    given = (bearer_credential(authorization) or "").encode("utf-8", "surrogateescape")
    matches = [hmac.compare_digest(given, token.encode()) for token in tokens if token]
    if not any(matches):
        raise ApiError(401, f"this endpoint needs 'Authorization: Bearer <{name}>'", type="AuthenticationError",
                       code=code, headers={"WWW-Authenticate": "Bearer"})


def is_loopback_host(host: str) -> bool:
    """Whether a server listening on `host` is reachable from this machine only. A name other than `localhost`
    counts as not loopback (it may resolve to anything); so do the wildcards `0.0.0.0`, `::` and ``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BodyWording:
    """How one server words the 400s for a body that is not a JSON object.

    `subject` starts every message ("The request body" on the engine, "the request body" on the gateway).
    `not_object` follows it for valid JSON of another type; it may name the type as `{json_type}` ("an array")
    or `{python_type}` ("list"). `not_object_code` is that error's code.
    """

    subject: str
    not_object: str
    not_object_code: str


def parse_json_body(raw: bytes, wording: BodyWording) -> dict[str, Any]:
    """The request body as a JSON object. Raises ApiError 400: code "invalid_json" for bytes that are not
    strict JSON text or that hold a lone UTF-16 surrogate escape, `wording.not_object_code` for another type."""
    try:
        value = loads_json_text(raw)
    except NotJsonText as exc:
        raise bad_request(f"{wording.subject} is {exc}", code="invalid_json") from exc
    if not isinstance(value, dict):
        detail = wording.not_object.format(json_type=json_type(value), python_type=type(value).__name__)
        raise bad_request(f"{wording.subject} {detail}", code=wording.not_object_code)
    if lone_surrogate_in(raw, value):
        raise bad_request(f"{wording.subject} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not "
                          "text", code="invalid_json")
    return value


def json_type(value: Any) -> str:
    """A decoded JSON value's type as a message names it: "null", "a boolean", "a number", "an array", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
