"""Admission of a tenant's request against its rate limits, through the state store (`router.limits` decides).

With a shared store (Redis) every gateway takes from the same buckets and counts in-flight requests in the same
counter, so N gateways together hold a tenant's limits. While the store cannot be reached, a tenant whose
`rate_limits.on_store_outage` is `open` is held by this gateway's own in-memory buckets (N gateways then admit
up to N times the limits), and one that is `closed` gets 503 with Retry-After.

Tokens per minute are reserved at admission (prompt estimate + `request_caps.completion_budget`) and settled in `release` from the
answer's usage: what was not used goes back to the bucket, an overrun is charged as debt (at most one bucket's
worth, `StateStore.adjust_tokens`). A request refused on tokens gets back the request it took from the
requests bucket, as it was not served.

Whatever happens after a request is counted in flight (a 429, a store error, a client that hangs up while the
store answers), its slot is given back: the admission runs to its end in a task of its own even when its
handler is cancelled, every way out of it releases, and the release is shielded from cancellation. A counter
that lapsed while a request ran is never decremented below 0 (see `_count_out`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace

from kvgate.clock import Clock
from kvgate.registry.schema import TenantDoc
from kvgate.registry.tenant import StoreOutage
from kvgate.router.errors import no_capacity
from kvgate.router.limits import Bucket, Remaining, rate_headers, rate_limited, settlement, token_reservation
from kvgate.state import MemoryStateStore, StateStore, StateStoreError, StateStoreUnavailable, TokenBucketResult
from kvgate.state.outage import Outage

log = logging.getLogger(__name__)

# An in-flight counter lapses this long after its last change: what a gateway that died mid-request leaves
# counted (its decrements never come) is forgotten once the tenant has been idle this long.
IN_FLIGHT_TTL_S = 600.0
STORE_RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class Reservation:
    """What one admission took from one of a tenant's buckets: to give back, or to settle."""

    key: str
    bucket: Bucket
    amount: int

    async def take(self, store: StateStore) -> TokenBucketResult:
        return await store.take_tokens(self.key, self.bucket.capacity, self.bucket.refill_per_s, self.amount)

    async def adjust(self, store: StateStore, delta: int) -> float:
        return await store.adjust_tokens(self.key, self.bucket.capacity, self.bucket.refill_per_s, delta)


@dataclass
class Admitted:
    """One admitted request: what to give back when it ends, and the headers its answer carries."""

    headers: dict[str, str] = field(default_factory=dict)
    in_flight_key: str | None = None  # the concurrency counter this request counts in
    store: StateStore | None = None  # where that counter (and the buckets) live
    tokens: Reservation | None = None  # the tokens per minute reserved, settled by `release`


class TenantLimiter:
    """Per-tenant limits over `store` (None: this gateway only) with a local fallback."""

    def __init__(self, store: StateStore | None, clock: Clock) -> None:
        self._local = MemoryStateStore(clock)
        self._shared = store
        self._clock = clock
        self._outage = Outage()
        self._orphans: set[asyncio.Task[None]] = set()  # releases of admissions whose caller went away

    async def admit(self, tenant: TenantDoc, prompt_tokens: int, completion_tokens: int) -> Admitted:
        """Take the request (its prompt estimate plus the `completion_tokens` it may cost) from the tenant's
        buckets and count it in flight; raises ApiError 429 (a limit reached), 400 (a cost no limit could ever
        admit) or 503 (store down, tenant `closed`). Every Admitted must be `release`d; if the caller is cancelled
        meanwhile, the admission still ends, and what it took is released here."""
        limits = tenant.spec.rate_limits
        if (limits.requests_per_minute is None and limits.tokens_per_minute is None
                and limits.max_concurrent_requests is None):
            return Admitted()
        tokens = (token_reservation(prompt_tokens, completion_tokens, limits.tokens_per_minute)
                  if limits.tokens_per_minute is not None else 0)
        admission = asyncio.ensure_future(self._admit_anywhere(tenant, tokens))
        try:
            return await asyncio.shield(admission)
        except asyncio.CancelledError:
            admission.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, admission: asyncio.Future[Admitted]) -> None:
        if admission.cancelled() or admission.exception() is not None:
            return  # nothing taken, or already given back by `_admit`
        release = asyncio.ensure_future(self.release(admission.result()))
        self._orphans.add(release)
        release.add_done_callback(self._orphans.discard)

    async def _admit_anywhere(self, tenant: TenantDoc, tokens: int) -> Admitted:
        """`_admit` on the shared store, or on this gateway's own while the shared one is unreachable."""
        limits = tenant.spec.rate_limits
        if self._shared is not None:
            try:
                admitted = await self._admit(self._shared, tenant, tokens)
            except StateStoreUnavailable as exc:
                note = self._outage.failed(self._clock.now())
                if note is not None:
                    log.warning("rate limits: %s; tenants held by this gateway alone or refused%s", exc, note)
                if limits.on_store_outage is StoreOutage.CLOSED:
                    raise no_capacity("rate limits cannot be checked right now; retry shortly", STORE_RETRY_AFTER_S,
                                      code="rate_limit_store_unavailable") from None
            else:
                recovered = self._outage.recovered(self._clock.now())
                if recovered is not None:
                    log.info("rate limits: the state store answers again %s", recovered)
                return admitted
        return await self._admit(self._local, tenant, tokens)

    async def _admit(self, store: StateStore, tenant: TenantDoc, tokens: int) -> Admitted:
        limits, name = tenant.spec.rate_limits, tenant.metadata.name
        admitted = Admitted(store=store)
        try:
            if limits.max_concurrent_requests is not None:
                key = f"tenant:{name}:in_flight"
                counted = await store.incr(key, 1, ttl_s=IN_FLIGHT_TTL_S)
                admitted.in_flight_key = key  # counted: from here on, every way out releases it
                if counted > limits.max_concurrent_requests:
                    raise rate_limited(f"concurrent requests (limit {limits.max_concurrent_requests})", 1.0, {})
            remaining, taken = Remaining(), list[Reservation]()
            for kind, limit, cost in (("requests", limits.requests_per_minute, 1),
                                      ("tokens", limits.tokens_per_minute, tokens)):
                if limit is None:
                    continue
                reservation = Reservation(f"tenant:{name}:{kind}", Bucket.per_minute(limit), cost)
                result = await reservation.take(store)
                remaining = replace(remaining, **{kind: result.remaining})
                if not result.allowed:
                    for earlier in taken:  # the request's token, when its tokens were refused: it is not served
                        with contextlib.suppress(StateStoreError):
                            await earlier.adjust(store, earlier.amount)
                    raise rate_limited(f"{kind} per minute (limit {limit:g})", result.retry_after_s,
                                       rate_headers(limits, remaining))
                taken.append(reservation)
            admitted.tokens = taken[-1] if limits.tokens_per_minute is not None else None
            admitted.headers = rate_headers(limits, remaining)
        except BaseException:  # a refusal, any store error, a bug: the slot must not stay counted
            await self.release(admitted)
            raise
        return admitted

    async def release(self, admitted: Admitted, tokens_used: int | None = None) -> None:
        """The request ended: it no longer counts in flight, and its reserved tokens are settled with the
        `tokens_used` its answer's usage reported (`limits.settlement`; None: the reservation stands). Each
        happens once however often this is called. The store calls run to their end even if the caller is
        cancelled meanwhile (it then gets CancelledError). Never raises otherwise."""
        store = admitted.store
        if store is None:
            return
        key, admitted.in_flight_key = admitted.in_flight_key, None
        reservation, admitted.tokens = admitted.tokens, None
        steps: list[Awaitable[object]] = [_count_out(store, key)] if key is not None else []
        delta = settlement(reservation.amount, tokens_used) if reservation is not None else 0
        if reservation is not None and delta:
            steps.append(reservation.adjust(store, delta))
        for result in await asyncio.shield(asyncio.gather(*steps, return_exceptions=True)):
            # Store down: the counter lapses (IN_FLIGHT_TTL_S), the reservation stands.
            if isinstance(result, Exception) and not isinstance(result, StateStoreError):
                log.warning("rate limits: could not release a request: %r", result)


async def _count_out(store: StateStore, key: str) -> None:
    """Take one request off the in-flight counter `key`, never below 0: a counter that lapsed (IN_FLIGHT_TTL_S)
    while the request ran reads 0, and left at -1 it would let one request more than the limit in; so a
    decrement that goes below 0 is undone. Each release undoes only its own decrement, so releases racing each
    other cannot leave the counter too high (0 -> -1, -2 -> +1, +1 -> 0), which would hold a slot forever."""
    if await store.incr(key, -1, ttl_s=IN_FLIGHT_TTL_S) < 0:
        await store.incr(key, 1, ttl_s=IN_FLIGHT_TTL_S)
