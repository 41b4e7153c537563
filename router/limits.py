"""A tenant's rate limits as decisions: no I/O, no clock reads (`router.admission` is the shell).

Requests and tokens per minute are token buckets in the state store, shared by every gateway, and concurrent
requests a counter beside them; one admission takes from all three in one atomic step (`quota_plan`,
`StateStore.take_quota`). A bucket refills at the limit / 60 per second and holds `burst_s` of it (3 s by
default, at least one request): over any minute a tenant gets at most the limit plus burst_s / 60 of it (5%),
whatever the number of gateways. (A bucket of a whole minute, as this was first, let an idle tenant send twice its
limit in its first minute; OpenAI enforces its per-minute limits over shorter periods for the same reason.)

A request reserves its prompt's estimate plus the completion tokens it may cost (`request_caps.completion_budget`:
max_tokens times n, the model's cap when it names none; at most the whole bucket); when the answer ends, its usage
settles the difference (`settlement`), an overrun charged as debt down to a minute of the limit. The answers carry
the headers OpenAI clients read (`x-ratelimit-*`, `Retry-After` on a 429); `x-ratelimit-remaining-*` is what the
bucket holds after this request's reservation, before its answer settles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.openai_wire import ApiError, bad_request
from kvgate.registry.tenant import RateLimits
from kvgate.state.quota import SLOT_REFUSED, BucketGive, BucketTake, QuotaResult, Slot

# An in-flight counter lapses this long after its last change: what a gateway that died mid-request leaves
# counted (its decrements never come) is forgotten once the tenant has been idle this long.
IN_FLIGHT_TTL_S = 600.0
# An overrun (an answer that used more tokens than it reserved) is charged down to this much of the limit in debt.
TOKEN_DEBT_S = 60.0


@dataclass(frozen=True)
class Bucket:
    """A per-minute limit as a token bucket: 60/min with a burst of 3 s -> capacity 3, refill 1 per second."""

    capacity: float
    refill_per_s: float

    @classmethod
    def per_minute(cls, limit: float, burst_s: float) -> Bucket:
        return cls(capacity=max(1.0, limit * burst_s / 60.0), refill_per_s=limit / 60.0)

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
        headers[f"x-ratelimit-reset-{kind}"] = duration_text(Bucket.per_minute(limit, limits.burst_s).reset_s(left))
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


@dataclass(frozen=True)
class QuotaPlan:
    """What one request takes from its tenant's limits in one step (`StateStore.take_quota`)."""

    slot: Slot | None  # the concurrent-requests counter, when that limit is set
    takes: tuple[BucketTake, ...]
    kinds: tuple[str, ...]  # "requests" or "tokens", one per take

    @property
    def tokens(self) -> BucketTake | None:
        """The tokens-per-minute reservation, which the answer's usage settles."""
        return next((take for take, kind in zip(self.takes, self.kinds) if kind == "tokens"), None)


def tenant_key(tenant: str, what: str) -> str:
    """A tenant's key in the state store: all of one tenant's in one Redis Cluster hash slot ({...})."""
    return f"{{tenant:{tenant}}}:{what}"


def quota_plan(tenant: str, limits: RateLimits, prompt_tokens: int, completion_tokens: int) -> QuotaPlan:
    """The slot and takes for a request of `prompt_tokens` that may cost `completion_tokens` more."""
    slot = (Slot(tenant_key(tenant, "in_flight"), limits.max_concurrent_requests, IN_FLIGHT_TTL_S)
            if limits.max_concurrent_requests is not None else None)
    takes, kinds = [], []
    for kind, limit in (("requests", limits.requests_per_minute), ("tokens", limits.tokens_per_minute)):
        if limit is None:
            continue
        bucket = Bucket.per_minute(limit, limits.burst_s)
        amount = 1 if kind == "requests" else token_reservation(prompt_tokens, completion_tokens, bucket.capacity)
        takes.append(BucketTake(tenant_key(tenant, kind), bucket.capacity, bucket.refill_per_s, amount))
        kinds.append(kind)
    return QuotaPlan(slot, tuple(takes), tuple(kinds))


def remaining_of(plan: QuotaPlan, result: QuotaResult) -> Remaining:
    """The buckets' levels after an admission, as the `x-ratelimit-remaining-*` headers show them."""
    return Remaining(**dict(zip(plan.kinds, result.levels)))


def refusal(limits: RateLimits, plan: QuotaPlan, result: QuotaResult) -> ApiError:
    """The 429 (or 400, `rate_limited`) for a `take_quota` that refused."""
    headers = rate_headers(limits, remaining_of(plan, result))
    if result.refused == SLOT_REFUSED:
        return rate_limited(f"concurrent requests (limit {limits.max_concurrent_requests})", 1.0, headers)
    kind = plan.kinds[(result.refused or 1) - 1]
    limit = limits.requests_per_minute if kind == "requests" else limits.tokens_per_minute
    return rate_limited(f"{kind} per minute (limit {limit:g})", result.retry_after_s, headers)


def token_settlement(plan: QuotaPlan, limits: RateLimits, used: int | None) -> BucketGive | None:
    """What to give back to (or charge) the tokens bucket when the answer ends; None: nothing to settle."""
    take = plan.tokens
    delta = settlement(int(take.amount), used) if take is not None else 0
    if take is None or not delta or limits.tokens_per_minute is None:
        return None
    return BucketGive(take.key, take.capacity, take.refill_per_s, delta,
                      floor=-limits.tokens_per_minute * TOKEN_DEBT_S / 60.0)
