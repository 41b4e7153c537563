"""The OpenAI wire shapes the engine and the gateway share: one error class, its answer, one body parser."""

from __future__ import annotations

import json

import pytest

from kvgate.engine.server import protocol as engine_protocol
from kvgate.openai_wire import (ApiError, BodyWording, bad_request, bearer_credential, error_response, json_type,
                                 parse_json_body, require_bearer)
from kvgate.router import handlers as gateway_handlers

# The words each server really uses, so a change to either shows up here as well as in its own tests.
ENGINE = engine_protocol._BODY_WORDING
GATEWAY = gateway_handlers._BODY_WORDING


def refusal(raw: bytes, wording: BodyWording) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw, wording)
    return caught.value


def test_a_json_object_body_is_returned_as_a_dict() -> None:
    assert parse_json_body(b'{"model": "m", "n": [1, 2]}', ENGINE) == {"model": "m", "n": [1, 2]}


@pytest.mark.parametrize("wording,message,code", [
    (ENGINE, "The request body must be a JSON object; got an array", "invalid_json"),
    (GATEWAY, "the request body must be a JSON object, not list", "invalid_type"),
])
def test_another_json_type_is_a_400_in_the_servers_own_words(wording, message, code) -> None:
    error = refusal(b"[1, 2]", wording)
    assert (error.status, error.type, error.param, error.code, error.message) == (
        400, "BadRequestError", None, code, message)


@pytest.mark.parametrize("raw,words", [
    (b"{not json", "is not valid JSON"),
    (b'{"x": NaN}', "is not valid JSON"),
    (b"[" * 2000 + b"]" * 2000, "is nested too deeply to parse"),
    (b'{"content": "\\ud800"}', "holds a lone UTF-16 surrogate escape"),
])
def test_bytes_that_are_no_json_text_are_invalid_json_whatever_the_wording(raw, words) -> None:
    for wording in (ENGINE, GATEWAY):
        error = refusal(raw, wording)
        assert (error.status, error.code) == (400, "invalid_json")
        assert error.message.startswith(f"{wording.subject} {words}")


def test_the_error_body_is_an_openai_error_object() -> None:
    error = bad_request("n must be 1", "n")
    assert error.body() == {"error": {"message": "n must be 1", "type": "BadRequestError", "param": "n",
                                      "code": "invalid_value"}}


def test_the_answer_carries_the_status_headers_and_body() -> None:
    error = ApiError(503, "busy", type="ServiceUnavailableError", code="no_capacity", headers={"Retry-After": "2"})
    response = error_response(error)
    assert (response.status, response.headers["Retry-After"], response.content_type) == (
        503, "2", "application/json")
    assert json.loads(response.text) == error.body()
    assert response.keep_alive is None  # left to aiohttp: the connection may be reused


def test_an_error_marked_close_ends_the_connection() -> None:
    response = error_response(ApiError(408, "slow body", type="RequestTimeoutError", close=True))
    assert response.keep_alive is False


@pytest.mark.parametrize("value,name", [
    (None, "null"), (True, "a boolean"), (3, "a number"), (1.5, "a number"), ("s", "a string"),
    ([1], "an array"), ({}, "an object"),
])
def test_json_type_names_a_value_as_a_message_does(value, name) -> None:
    assert json_type(value) == name


@pytest.mark.parametrize(("header", "credential"), [
    ("Bearer t0k", "t0k"), ("bearer t0k", "t0k"), ("BEARER  t0k ", "t0k"),  # RFC 7235: the scheme in any case
    ("Basic t0k", None), ("Bearert0k", None), ("Bearer", None), ("Bearer   ", None), ("", None), (None, None),
])
def test_a_bearer_credential_is_read_whatever_the_schemes_case(header: str | None, credential: str | None) -> None:
    assert bearer_credential(header) == credential


def test_require_bearer_takes_any_of_its_tokens_in_any_scheme_case_and_refuses_the_rest() -> None:
    require_bearer("bearer admin-t", ["admin-t", "metrics-t"], name="admin token")
    require_bearer("Bearer metrics-t", ["admin-t", "metrics-t"], name="admin token")
    for header in (None, "Bearer admin-tx", "Basic admin-t", "Bearer ", "admin-t"):
        with pytest.raises(ApiError) as refused:
            require_bearer(header, ["admin-t", ""], name="admin token")
        assert refused.value.status == 401 and refused.value.headers == {"WWW-Authenticate": "Bearer"}
        assert "admin-t" not in refused.value.message
