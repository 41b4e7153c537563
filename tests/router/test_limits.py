"""A tenant's rate limits as decisions (`router.limits`): bucket sizes from per-minute limits, what a request
reserves and settles, the `x-ratelimit-*` headers OpenAI clients read, and the 429 they get."""

from __future__ import annotations

import json
import math

import pytest

from kvgate.openai_wire import error_response
from kvgate.registry.tenant import RateLimits
from kvgate.router.limits import (
    Bucket, Remaining, duration_text, rate_headers, rate_limited, settlement, token_reservation,
)
from kvgate.router.request_caps import completion_budget


@pytest.mark.parametrize("per_minute, burst_s, capacity, refill_per_s", [
    (60, 3, 3, 1.0),  # one a second, 3 s worth at once
    (600, 3, 30, 10.0),
    (5, 3, 1, 5 / 60),  # one every 12 s, and never less than one request at once
    (90_000, 3, 4_500, 1_500.0),  # tokens per minute
    (60, 60, 60, 1.0),  # a minute's worth at once
])
def test_a_per_minute_limit_is_a_bucket_of_burst_s_refilled_at_the_limit_over_60(
        per_minute: float, burst_s: float, capacity: float, refill_per_s: float) -> None:
    assert Bucket.per_minute(per_minute, burst_s) == Bucket(capacity=capacity, refill_per_s=refill_per_s)


@pytest.mark.parametrize("per_minute, remaining, reset_s", [
    (60, 1, 2.0),  # 1 of 3 left at 1/s
    (60, 3, 0.0),  # full
    (60, 75, 0.0),  # above capacity (a lowered limit) is full, not a negative wait
    (600, 0, 3.0),  # empty: 3 s
    (60, -30, 33.0),  # in debt after an overrun: the debt and then the bucket
])
def test_reset_is_the_time_until_the_bucket_is_full_again(per_minute: float, remaining: float,
                                                          reset_s: float) -> None:
    assert Bucket.per_minute(per_minute, 3).reset_s(remaining) == pytest.approx(reset_s)


@pytest.mark.parametrize("prompt, completion, capacity, reserved", [
    (100, 50, 10_000, 150),  # prompt plus completion
    (100, 5000, 1000, 1000),  # never more than the bucket holds, or it could never be admitted
    (10, 10, 15.5, 15),  # ... a whole number of tokens of it
    (0, 0, 100, 1),  # at least one token: every request costs something
])
def test_a_request_reserves_its_prompt_and_completion_within_the_bucket(
        prompt: int, completion: int, capacity: float, reserved: int) -> None:
    assert token_reservation(prompt, completion, capacity) == reserved


@pytest.mark.parametrize("body, budget", [
    ({"max_tokens": 50}, 50),
    ({}, 2048),  # neither: the model's cap, what a server may then generate
    ({"max_tokens": None, "n": None}, 2048),  # null is unset
    ({"max_tokens": 1, "max_completion_tokens": 200}, 200),  # servers let max_completion_tokens win
    ({"max_tokens": 200, "max_completion_tokens": 1}, 200),  # ... or max_tokens: the larger is reserved
    ({"max_tokens": 100, "n": 3}, 300),  # each of n choices may run to max_tokens
    ({"max_tokens": 100, "n": 2, "best_of": 5}, 500),  # best_of sequences are drawn, n of them returned
    ({"n": 2}, 4096),
])
def test_a_requests_completion_budget_is_its_largest_max_tokens_times_its_choices(body: dict, budget: int) -> None:
    assert completion_budget(body, 2048) == budget


def test_a_cost_that_no_wait_would_admit_is_a_400_without_retry_after() -> None:
    # What the store answers (retry_after_s = inf) for a cost above the bucket's capacity: ceil(inf) would raise.
    error = rate_limited("requests per minute (limit 0.5)", math.inf, {"x-ratelimit-remaining-requests": "0"})
    assert (error.status, error.code, error.type) == (400, "rate_limit_unreachable", "BadRequestError")
    assert "Retry-After" not in error.headers and "can never be admitted" in error.message


@pytest.mark.parametrize("reserved, used, delta", [
    (150, 40, 110),  # unused: given back
    (150, 150, 0),  # as reserved
    (150, 200, -50),  # an overrun: charged
    (150, None, 0),  # usage unknown: the reservation stands
    (150, 0, 150),
])
def test_settlement_gives_back_what_was_not_used_and_charges_an_overrun(reserved: int, used: int | None,
                                                                         delta: int) -> None:
    assert settlement(reserved, used) == delta


@pytest.mark.parametrize("seconds, text", [
    (0.02, "20ms"), (0.0001, "1ms"), (0.999, "999ms"), (0.0, "0ms"),
    (1.0, "1s"), (6.0, "6s"), (6.2, "7s"), (59.2, "1m0s"), (90.0, "1m30s"), (120.0, "2m0s"),
])
def test_reset_times_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


def test_headers_say_limit_remaining_and_reset_of_each_limit_set() -> None:
    # 5 requests a minute hold one at once (3 s of 5 a minute is under one); 0.7 left: 0 whole ones; full again
    # in (1 - 0.7) / (5 / 60) = 3.6 s -> "4s". 6,000 tokens a minute hold 300 at once; 250 left: full again in
    # 50 / 100 = 0.5 s.
    limits = RateLimits(requests_per_minute=5, tokens_per_minute=6000)
    assert rate_headers(limits, Remaining(requests=0.7, tokens=250)) == {
        "x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "4s",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "250",
        "x-ratelimit-reset-tokens": "500ms",
    }


def test_headers_leave_out_a_limit_not_set_or_not_measured() -> None:
    assert rate_headers(RateLimits(requests_per_minute=5), Remaining(requests=4, tokens=100)).keys() == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"}
    assert rate_headers(RateLimits(requests_per_minute=5, tokens_per_minute=60), Remaining(requests=4)).keys() == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"}
    assert rate_headers(RateLimits(max_concurrent_requests=2), Remaining()) == {}


def test_a_bucket_in_debt_shows_nothing_remaining() -> None:
    headers = rate_headers(RateLimits(tokens_per_minute=600), Remaining(tokens=-300))
    # 600 a minute refill 10 a second into a bucket of 30: (30 + 300) / 10 = 33 s.
    assert headers["x-ratelimit-remaining-tokens"] == "0" and headers["x-ratelimit-reset-tokens"] == "33s"


@pytest.mark.parametrize("retry_after_s, header", [(0.2, "1"), (1.0, "1"), (2.1, "3"), (0.0, "1"), (61.5, "62")])
def test_a_429_says_retry_after_in_whole_seconds_at_least_one(retry_after_s: float, header: str) -> None:
    error = rate_limited("requests per minute (limit 5)", retry_after_s, {"x-ratelimit-remaining-requests": "0"})
    assert error.status == 429
    assert error.headers == {"x-ratelimit-remaining-requests": "0", "Retry-After": header}
    assert error.message.endswith(f"retry after {header} s.")


def test_a_429_is_openais_rate_limit_error_object() -> None:
    response = error_response(rate_limited("tokens per minute (limit 600)", 3.0, {}))
    assert response.status == 429 and response.headers["Retry-After"] == "3"
    assert json.loads(response.body) == {"error": {
        "message": "Rate limit reached for tokens per minute (limit 600); retry after 3 s.",
        "type": "RateLimitError", "param": None, "code": "rate_limit_exceeded"}}
