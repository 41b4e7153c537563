"""A tenant's rate limits as decisions: no I/O, no clock reads (`router.admission` is the shell).

Requests and tokens per minute are token buckets in the state store (`StateStore.take_tokens`), shared by every
gateway: a bucket holds one minute's worth (a tenant idle for a minute may send it at once) and refills at the
limit / 60 per second, so over a sustained load the tenant gets its declared rate whatever the number of gateways.
A request reserves its prompt's estimate plus the completion tokens it may cost (`request_caps.completion_budget`:
max_tokens times n, the model's cap when it names none; at most the whole bucket); when the answer ends, its usage
settles the difference (`settlement`). The answers carry the
headers OpenAI clients read (`x-ratelimit-*`, `Retry-After` on a 429).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.openai_wire import ApiError, bad_request
from kvgate.registry.tenant import RateLimits


@dataclass(frozen=True)
class Bucket:
    """A per-minute limit as a token bucket: 60/min -> capacity 60, refill 1 per second."""

    capacity: float
    refill_per_s: float

    @classmethod
    def per_minute(cls, limit: float) -> Bucket:
        return cls(capacity=limit, refill_per_s=limit / 60.0)

    def reset_s(self, remaining: float) -> float:
        """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`): 30 of 60 left -> 30 s."""
        return max(0.0, self.capacity - remaining) / self.refill_per_s


def token_reservation(prompt_tokens: int, completion_tokens: int, capacity: float) -> int:
    """Tokens a request reserves at admission: prompt 100 + completion 50 -> 150. Never over the bucket's
    capacity (what could never be admitted otherwise): the answer's usage settles the difference."""
    return max(1, min(prompt_tokens + completion_tokens, math.floor(capacity)))


def settlement(reserved: int, used: int | None) -> int:
    """Tokens to put back in the tenant's bucket when the answer ends: reserved 150, used 40 -> +110; used 200
    -> -50 (an overrun: charged, and the next requests wait for it); usage unknown (a stream without
    `stream_options.include_usage`, a failed request) -> 0, the reservation stands."""
    return 0 if used is None else reserved - used


def duration_text(seconds: float) -> str:
    """OpenAI's form of a reset time: 0.02 -> "20ms", 6 -> "6s", 90 -> "1m30s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


@dataclass(frozen=True)
class Remaining:
    """What one admission left of a tenant's per-minute limits (None: that limit is not set)."""

    requests: float | None = None
    tokens: float | None = None


def rate_headers(limits: RateLimits, remaining: Remaining) -> dict[str, str]:
    """The `x-ratelimit-*` headers for `remaining` of `limits`, for the limits that are set."""
    headers: dict[str, str] = {}
    for kind, limit, left in (("requests", limits.requests_per_minute, remaining.requests),
                              ("tokens", limits.tokens_per_minute, remaining.tokens)):
        if limit is None or left is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(math.floor(limit))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(left)))
        headers[f"x-ratelimit-reset-{kind}"] = duration_text(Bucket.per_minute(limit).reset_s(left))
    return headers


def rate_limited(what: str, retry_after_s: float, headers: dict[str, str]) -> ApiError:
    """429 rate_limit_exceeded with Retry-After (whole seconds, at least 1) and the x-ratelimit headers; or, for
    a wait that never ends (the store's math.inf: a cost above the bucket's capacity, which no retry would
    admit), 400 rate_limit_unreachable, with no Retry-After to retry on."""
    if not math.isfinite(retry_after_s):
        return bad_request(f"This request can never be admitted under the tenant's {what}: it costs more than "
                           "a whole minute of it; the operator must raise the limit.", code="rate_limit_unreachable")
    return ApiError(429, f"Rate limit reached for {what}; retry after {max(1, math.ceil(retry_after_s))} s.",
                    type="RateLimitError", code="rate_limit_exceeded",
                    headers={**headers, "Retry-After": str(max(1, math.ceil(retry_after_s)))})
