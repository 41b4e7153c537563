"""Tenants' rate limits held together by gateways that share a real redis-server, and what happens while it is
down: two in-process gateways over sim replicas, raw HTTP with each tenant's key."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio
from aiohttp import web

from kvgate.clock import FakeClock, RealClock
from kvgate.openai_wire import ApiError
from kvgate.registry.schema import TenantDoc
from kvgate.registry.tenant import key_hmac
from kvgate.router.admission import TenantLimiter
from kvgate.router.app import GatewaySettings
from kvgate.router.limits import IN_FLIGHT_TTL_S, tenant_key
from kvgate.state import RedisStateStore
from kvgate.state.quota import QuotaResult
from tests.eventually import eventually
from tests.router.sim_gateway import answer_with_usage, chat, gateway, hand_written_replica

SECRET = b"limits-test-secret-0123456789abcdefghij"
KEY = "kvg_limited-tenant-key"
KEYED = GatewaySettings(key_secret=SECRET)
IN_FLIGHT = tenant_key("acme", "in_flight")


def write_tenant(root: Path, limits: str) -> None:
    (root / "tenants.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Tenant
metadata: {{name: acme}}
spec: {{api_key_hmac: "{key_hmac(SECRET, KEY)}", models: ['*'], rate_limits: {limits}}}
""")


async def send(url: str, body: dict | None = None) -> tuple[int, dict[str, str], dict | str]:
    """(status, headers, JSON body, or the text of a stream) of one chat request with the tenant's key."""
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", data=json.dumps(body or chat("hi")),
                                                    headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.content_type == "text/event-stream":
            return r.status, dict(r.headers), await r.text()
        return r.status, dict(r.headers), await r.json(content_type=None)


def unreachable_redis_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


async def test_two_gateways_sharing_redis_hold_a_5_per_minute_limit_together(tmp_path: Path, redis_url: str) -> None:
    prefix, clock = f"test-{uuid.uuid4().hex[:8]}:", RealClock()
    stores = [RedisStateStore.from_url(redis_url, clock, prefix=prefix) for _ in range(2)]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_tenant(tmp_path / name, "{requests_per_minute: 5, burst_s: 60}")
    try:
        async with gateway(tmp_path / "a", num_replicas=1, settings=KEYED, store=stores[0]) as a, \
                gateway(tmp_path / "b", num_replicas=1, settings=KEYED, store=stores[1]) as b:
            answers = [await send((a, b)[i % 2].url) for i in range(20)]
    finally:
        for store in stores:
            await store.close()
    statuses = [status for status, _, _ in answers]
    assert statuses.count(200) == 5 and statuses.count(429) == 15, statuses
    ok = next(headers for status, headers, _ in answers if status == 200)
    assert ok["x-ratelimit-limit-requests"] == "5" and "x-ratelimit-reset-requests" in ok
    status, headers, body = next(answer for answer in answers if answer[0] == 429)
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "RateLimitError"
    assert int(headers["Retry-After"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"


async def test_concurrent_requests_over_the_limit_get_429(tmp_path: Path) -> None:
    write_tenant(tmp_path, "{max_concurrent_requests: 1}")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        await gw.fail(gw.sims[0], slow_first_byte_s=0.5)
        statuses = sorted(status for status, _, _ in await asyncio.gather(*(send(gw.url) for _ in range(4))))
        after = (await send(gw.url))[0]  # the one in flight has ended: its slot is free again
    assert statuses == [200, 429, 429, 429] and after == 200


async def test_while_the_store_is_down_an_open_tenant_is_held_locally_and_a_closed_one_refused(
        tmp_path: Path) -> None:
    clock = RealClock()
    for name, outage in (("open", "open"), ("closed", "closed")):
        (tmp_path / name).mkdir()
        write_tenant(tmp_path / name, f"{{requests_per_minute: 2, burst_s: 60, on_store_outage: {outage}}}")
    down = [RedisStateStore.from_url(unreachable_redis_url(), clock, prefix="x:", timeout_s=0.5) for _ in range(2)]
    try:
        async with gateway(tmp_path / "open", num_replicas=1, settings=KEYED, store=down[0]) as gw:
            opened = [(await send(gw.url))[0] for _ in range(4)]
        async with gateway(tmp_path / "closed", num_replicas=1, settings=KEYED, store=down[1]) as gw:
            status, headers, body = await send(gw.url)
    finally:
        for store in down:
            await store.close()
    assert opened == [200, 200, 429, 429]
    assert status == 503 and body["error"]["code"] == "rate_limit_store_unavailable" and "Retry-After" in headers


# Settlement of tokens per minute. The model caps max_tokens at 200, so a request naming none reserves its prompt
# plus 200 (about 210 of a 300 bucket, a minute's burst: one at a time, without settlement), while a sim answers
# 16 tokens.
CAPPED = "limits: {max_tokens: 200}"
UNCAPPED_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_tokens_a_request_reserved_and_did_not_use_come_back_when_its_answer_reports_usage(
        tmp_path: Path) -> None:
    write_tenant(tmp_path, "{tokens_per_minute: 300, burst_s: 60}")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED, spec=CAPPED) as gw:
        answers = [await send(gw.url, UNCAPPED_CHAT) for _ in range(4)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 200]
    assert all(body["usage"]["completion_tokens"] == 16 for _, _, body in answers)


async def test_a_stream_that_reports_usage_settles_and_one_that_does_not_keeps_its_reservation(
        tmp_path: Path) -> None:
    write_tenant(tmp_path, "{tokens_per_minute: 300, burst_s: 60}")
    silent = {**UNCAPPED_CHAT, "stream": True}
    reporting = {**silent, "stream_options": {"include_usage": True}}
    async with gateway(tmp_path, num_replicas=1, settings=KEYED, spec=CAPPED) as gw:
        first = await send(gw.url, silent)
        await asyncio.sleep(0.2)  # what would settle it has had time to
        refused = await send(gw.url, reporting)  # the silent stream's ~210 stand: ~90 of 300 left
    write_tenant(tmp_path, "{tokens_per_minute: 300, burst_s: 60}")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED, spec=CAPPED) as gw:
        reported = await send(gw.url, reporting)
        # The stream settles once the client has its [DONE]; long before 22 s of refill would admit another.
        again = await eventually(lambda: _admitted(send(gw.url, reporting)), "a second stream admitted",
                                 timeout_s=5.0)
    assert first[0] == 200 and "[DONE]" in first[2] and refused[0] == 429
    assert reported[0] == 200 and '"usage"' in reported[2] and again[0] == 200


async def _admitted(answer: Awaitable[tuple[int, dict[str, str], dict | str]]) -> tuple | None:
    status, headers, body = await answer
    return (status, headers, body) if status == 200 else None


async def test_an_answer_that_overran_its_reservation_is_charged_to_the_next_requests(tmp_path: Path) -> None:
    # 600 per minute (10 a second); the answer reports 2,010 tokens for a reservation of about 6: the bucket is
    # left in debt, 30 - 2,010 capped at a minute of the limit (-600), so the next request waits (6 + 600) / 10
    # = ~61 s.
    async def overrun(request: web.Request) -> web.Response:
        return web.Response(body=answer_with_usage('{"prompt_tokens": 10, "completion_tokens": 2000}'),
                            content_type="application/json")

    write_tenant(tmp_path, "{tokens_per_minute: 600}")
    async with hand_written_replica(chat_completions=overrun) as url, \
            gateway(tmp_path, num_replicas=0, other_urls=(url,), settings=KEYED) as gw:
        answers = [await send(gw.url) for _ in range(2)]
    assert [status for status, _, _ in answers] == [200, 429]
    assert 60 <= int(answers[1][1]["Retry-After"]) <= 62 and answers[1][1]["x-ratelimit-remaining-tokens"] == "0"


async def test_a_request_refused_on_tokens_gives_back_its_request(tmp_path: Path) -> None:
    # 2 requests and 300 tokens a minute: the second asks for 250 tokens of the ~40 left and is refused; the
    # request it took comes back, so a third, small one still fits the requests bucket.
    write_tenant(tmp_path, "{requests_per_minute: 2, tokens_per_minute: 300, burst_s: 60}")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        statuses = [(await send(gw.url, chat("hi", max_tokens=n)))[0] for n in (250, 250, 4)]
    assert statuses == [200, 429, 200]


# The bar: two gateways sharing a real redis-server hold a tenant's rate within 5% of the declared one.
# Both run on one FakeClock (the Redis buckets refill by the callers' clock, not Redis's), offered 4x the limit
# for three minutes: the first minute admits the limit plus its 3 s burst (a full bucket, then its refill), each
# later minute the limit alone. Two buckets, one per gateway, would admit twice that.
STEP_S, NUM_STEPS = 0.5, 360  # one request to each gateway every half second: 240 a minute offered


async def admitted_each_minute(tmp_path: Path, redis_url: str, limits: str,
                               count: Callable[[dict], float]) -> list[float]:
    """The sum of `count(answer)` over the answers admitted in each minute of fake time, by two gateways
    offered the load above."""
    prefix, clock = f"test-{uuid.uuid4().hex[:8]}:", FakeClock()
    stores = [RedisStateStore.from_url(redis_url, clock, prefix=prefix) for _ in range(2)]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_tenant(tmp_path / name, limits)
    per_minute = [0.0] * math.ceil(NUM_STEPS * STEP_S / 60)
    try:
        async with gateway(tmp_path / "a", num_replicas=1, settings=KEYED, store=stores[0], clock=clock) as a, \
                gateway(tmp_path / "b", num_replicas=1, settings=KEYED, store=stores[1], clock=clock) as b:
            for step in range(NUM_STEPS):
                for status, _, answer in await asyncio.gather(send(a.url), send(b.url)):
                    if status == 200:
                        per_minute[int(step * STEP_S // 60)] += count(answer)
                await clock.advance(STEP_S)
    finally:
        for store in stores:
            await store.close()
    return per_minute


async def test_two_gateways_hold_a_requests_per_minute_limit_within_5_percent_minute_after_minute(
        tmp_path: Path, redis_url: str) -> None:
    minutes = await admitted_each_minute(tmp_path, redis_url, "{requests_per_minute: 60}", lambda _: 1)
    assert all(abs(n - 60) <= 0.05 * 60 for n in minutes), minutes


async def test_two_gateways_hold_a_tokens_per_minute_limit_within_5_percent_once_usage_settles(
        tmp_path: Path, redis_url: str) -> None:
    # Each request reserves its prompt's estimate + 4 and its answer reports what it used: the tokens reported
    # per minute, not the reservations, are what the limit holds.
    minutes = await admitted_each_minute(tmp_path, redis_url, "{tokens_per_minute: 600}",
                                         lambda answer: answer["usage"]["total_tokens"])
    assert all(abs(n - 600) <= 0.05 * 600 for n in minutes), minutes


# What a request reserves of tokens per minute: its largest max_tokens times its choices. Streams that do not ask
# for usage are never settled, so each reservation stands and the second one finds what the first left.
@pytest.mark.parametrize("asked", [
    {"max_tokens": 1, "max_completion_tokens": 250},  # servers let max_completion_tokens win: it is reserved
    {"max_tokens": 100, "n": 3},  # three choices of up to 100 tokens each
    {"max_tokens": 100, "best_of": 3},
])
async def test_a_request_reserves_its_largest_max_tokens_times_its_choices(tmp_path: Path, asked: dict) -> None:
    # 300 tokens a minute: one such request reserves ~256 (or all 300), leaving too little for a second; before,
    # each reserved its prompt plus max_tokens alone (~6 or ~106), and 20 of them got ~4,000 tokens through.
    write_tenant(tmp_path, "{tokens_per_minute: 300, burst_s: 60}")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        answers = [await send(gw.url, chat("hi", stream=True, **asked)) for _ in range(2)]
    assert [status for status, _, _ in answers] == [200, 429], answers


class HeldTakes(RedisStateStore):
    """A real redis store whose `take_quota` waits until `go` is set: the client can hang up mid-admission."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting, self.go, self.taken = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def take_quota(self, *args: Any, **kwargs: Any) -> QuotaResult:
        self.waiting.set()
        await self.go.wait()
        result = await super().take_quota(*args, **kwargs)
        self.taken.set()
        return result


async def test_a_client_that_hangs_up_during_admission_gives_its_concurrency_slot_back(
        tmp_path: Path, redis_url: str) -> None:
    # The client goes away while the store counts it in flight: its handler is cancelled. Before, nothing
    # released the slot, and with a limit of 1 the tenant got 429 until the counter lapsed.
    store = HeldTakes.from_url(redis_url, RealClock(), prefix=f"test-{uuid.uuid4().hex[:8]}:")
    write_tenant(tmp_path, "{requests_per_minute: 1000, max_concurrent_requests: 1}")
    try:
        async with gateway(tmp_path, num_replicas=1, settings=KEYED, store=store) as gw:
            hung_up = asyncio.ensure_future(send(gw.url))
            await asyncio.wait_for(store.waiting.wait(), 5.0)
            hung_up.cancel()  # closes the connection mid-admission
            await asyncio.gather(hung_up, return_exceptions=True)
            await asyncio.sleep(0.3)  # the gateway sees the connection go and cancels the handler
            store.go.set()
            await asyncio.wait_for(store.taken.wait(), 5.0)  # counted in flight, for a client that has gone
            await eventually(lambda: _counted_out(store), "the hung-up request's slot given back", timeout_s=5.0)
            after = await send(gw.url)
    finally:
        await store.close()
    assert after[0] == 200, after


async def _counted_out(store: RedisStateStore) -> bool:
    return await store.get_counter(IN_FLIGHT) == 0


async def test_a_store_error_during_admission_is_held_locally_and_takes_no_slot(tmp_path: Path,
                                                                                 redis_url: str) -> None:
    # The requests bucket's key holds a string: redis answers WRONGTYPE, a StateStoreError that is not an outage,
    # and that no retry mends. Before, the client got a 500; now the tenant (open by default) is held by this
    # gateway's own buckets, as during an outage, and nothing stays counted in Redis.
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)
    broken = redis.asyncio.Redis.from_url(redis_url)
    await broken.set(f"{prefix}bucket:{IN_FLIGHT.replace('in_flight', 'requests')}", "not a bucket")
    write_tenant(tmp_path, "{requests_per_minute: 1000, max_concurrent_requests: 1}")
    try:
        async with gateway(tmp_path, num_replicas=1, settings=KEYED, store=store) as gw:
            failed = await send(gw.url)
            counted = await store.get_counter(IN_FLIGHT)
            await broken.delete(f"{prefix}bucket:{IN_FLIGHT.replace('in_flight', 'requests')}")
            after = await send(gw.url)
    finally:
        await store.close()
        await broken.aclose()
    assert failed[0] == 200 and counted == 0 and after[0] == 200, (failed, counted, after)


async def test_a_release_after_the_counter_lapsed_does_not_grant_an_extra_slot(redis_url: str) -> None:
    # A request runs past IN_FLIGHT_TTL_S: its counter lapses to 0, and its release would leave -1, letting two
    # requests in under a limit of 1. The release stops at 0 instead.
    clock = FakeClock()
    store = RedisStateStore.from_url(redis_url, clock, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    limiter = TenantLimiter(store, clock)
    tenant = TenantDoc.model_validate({"apiVersion": "kvgate/v1", "kind": "Tenant", "metadata": {"name": "acme"},
                                       "spec": {"api_key_hmac": "ab" * 32, "models": ["*"],
                                                "rate_limits": {"max_concurrent_requests": 1}}})
    try:
        long_one = await limiter.admit(tenant, 10, 10)
        await clock.advance(IN_FLIGHT_TTL_S + 1)
        await limiter.release(long_one)
        first = await limiter.admit(tenant, 10, 10)
        with pytest.raises(ApiError) as refused:
            await limiter.admit(tenant, 10, 10)
        counted = await store.get_counter(IN_FLIGHT)
        await limiter.release(first)
    finally:
        await store.close()
    assert refused.value.status == 429 and counted == 1
