"""`RedisStateStore`: the state store shared by N gateways and the autoscaler, on `redis.asyncio`.

Time stays logical, as in the memory store: the caller's clock gives `now` (wall seconds) to every
Lua script, and each value carries its own `expires_at`. Redis's key TTLs are only a garbage-
collection backstop, set to the logical ttl plus `gc_slack_s` (default 60 s), so a key nobody reads
again still goes away, while clock skew between hosts of up to the slack never lets Redis delete a
record that is logically live. The tests drive a FakeClock against a real redis-server on this basis.

Every read-modify-write is one Lua script, so it is atomic across gateways. All but the quota scripts touch one
key and work on Redis Cluster as they are; `take_quota` / `return_quota` touch a tenant's counter and buckets
together, whose keys carry one hash tag (`router.limits.tenant_key`). The quota scripts, called for every
admitted request, go in automatic pipelines (`redis_batch`). Key layout, under `prefix` (default "kvgate:"):

    {prefix}members               hash  replica_id -> "<expires_at>\\n<MemberRecord JSON>"
    {prefix}counter:{key}         hash  value, expires_at
    {prefix}bucket:{key}          hash  tokens, updated_at
    {prefix}lease:{name}          hash  holder, expires_at
    {prefix}records:{collection}  hash  record_id -> "<version>\\n<data JSON>"

Numbers cross into Lua as Python `repr` strings and are written back with "%.17g", so floats
round-trip exactly and the bucket arithmetic matches the memory store's to the last bit.
Redis errors are mapped once, here: connection errors and timeouts become `StateStoreUnavailable`,
anything else `StateStoreError`; each message names the server by its URL without the password
(`redact_url`), so a caller can log it as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvgate.clock import Clock
from kvgate.state.base import (
    JSONValue, MemberRecord, StateStoreError, StateStoreUnavailable, StoredRecord, TokenBucketResult,
    VersionConflict, check_bucket_args, check_delta, check_expected_version, check_name,
    check_ttl_s, decode_record_data, encode_record_data,
)
from kvgate.state.quota import BucketGive, BucketTake, QuotaResult, Slot
from kvgate.state.redis_batch import Script, ScriptBatcher
from kvgate.state.schema import NewerSchema, SkippedRecords

log = logging.getLogger(__name__)

# KEYS[1] members hash; ARGV: replica_id, envelope, gc_ms. Only ever lengthen the hash's backstop
# TTL: it covers every member, and one with a shorter ttl must not cut the others' short.
_PUT_MEMBER = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local gc_ms = tonumber(ARGV[3])
if redis.call('PTTL', KEYS[1]) < gc_ms then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

# KEYS[1] members hash; ARGV: now. Returns live envelopes; deletes expired ones in the same step,
# so a heartbeat that lands between the read and the delete cannot be lost.
_LIST_MEMBERS = """
local now = tonumber(ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  if tonumber(string.match(all[i + 1], '^([^\\n]+)\\n')) > now then
    live[#live + 1] = all[i + 1]
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return live
"""

# KEYS[1] members hash; ARGV: replica_id, now. Returns 1 if a live member was removed.
_REMOVE_MEMBER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if tonumber(string.match(cur, '^([^\\n]+)\\n')) > tonumber(ARGV[2]) then return 1 end
return 0
"""

# KEYS[1] counter hash; ARGV: now, delta, expires_at, gc_ms. An expired value counts as 0.
_INCR = """
local cur = redis.call('HMGET', KEYS[1], 'value', 'expires_at')
local value = 0
if cur[1] and tonumber(cur[2]) > tonumber(ARGV[1]) then value = tonumber(cur[1]) end
value = value + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'value', string.format('%d', value), 'expires_at', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return value
"""

# The bucket scripts share two Lua functions: the refill (an absent bucket starts full) and the write. They
# mirror memory.take_from_bucket, quota.decide_take and memory.give_to_bucket. Numbers go back as strings, since
# Redis truncates Lua floats in replies. The backstop TTL is the time until the bucket is full again, when
# deleting it changes nothing.
_STORE_BUCKET = """
local function store_bucket(key, tokens, updated_at, capacity, rate, slack_ms)
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens), 'updated_at', string.format('%.17g', updated_at))
  if rate > 0 then
    redis.call('PEXPIRE', key, string.format('%d', math.ceil((capacity - tokens) / rate * 1000) + slack_ms))
  else
    redis.call('PERSIST', key)
  end
end
local function refilled(key, now, capacity, rate)
  local cur = redis.call('HMGET', key, 'tokens', 'updated_at')
  if not cur[1] then return capacity, now end
  local last = tonumber(cur[2])
  return math.min(capacity, tonumber(cur[1]) + math.max(0, now - last) * rate), math.max(last, now)
end
"""

# KEYS[1] bucket hash; ARGV: now, capacity, refill_per_s, cost, gc_slack_ms. Returns {allowed 0/1, remaining,
# retry_after_s}.
_TAKE_TOKENS = _STORE_BUCKET + """
local now, capacity, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, updated_at = refilled(KEYS[1], now, capacity, rate)
local allowed, retry = 0, 'inf'
if cost > capacity then
  -- never allowed; retry stays 'inf'
elseif tokens >= cost then
  tokens = tokens - cost
  allowed, retry = 1, '0'
elseif rate > 0 then
  retry = string.format('%.17g', (cost - tokens) / rate)
end
store_bucket(KEYS[1], tokens, updated_at, capacity, rate, tonumber(ARGV[5]))
return {allowed, string.format('%.17g', tokens), retry}
"""

# `take_quota` and `return_quota`: a slot counter and buckets in one step. KEYS: the slot's counter hash when
# ARGV[2] is '1', then the buckets' hashes.
# ARGV: now, has_slot, slot_limit, slot_expires_at, slot_gc_ms, gc_slack_ms, then capacity, rate, amount per
# bucket. Returns {allowed 0/1, refused (-1 none, 0 slot, i bucket i), retry_after_s, level per bucket}.
_TAKE_QUOTA = _STORE_BUCKET + """
local now, has_slot, slack_ms = tonumber(ARGV[1]), ARGV[2] == '1', tonumber(ARGV[6])
local first = has_slot and 2 or 1
local levels, stamps = {}, {}
for k = first, #KEYS do
  local j = 7 + 3 * (k - first)
  levels[#levels + 1], stamps[#stamps + 1] = refilled(KEYS[k], now, tonumber(ARGV[j]), tonumber(ARGV[j + 1]))
end
local function answer(allowed, refused, retry)
  local out = {allowed, refused, retry}
  for i = 1, #levels do out[#out + 1] = string.format('%.17g', levels[i]) end
  return out
end
local in_flight = 0
if has_slot then
  local cur = redis.call('HMGET', KEYS[1], 'value', 'expires_at')
  if cur[1] and tonumber(cur[2]) > now then in_flight = math.max(0, tonumber(cur[1])) end
  if in_flight + 1 > tonumber(ARGV[3]) then return answer(0, 0, '0') end
end
for i = 1, #levels do
  local j = 7 + 3 * (i - 1)
  local capacity, rate, amount = tonumber(ARGV[j]), tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  if amount > capacity then return answer(0, i, 'inf') end
  if levels[i] < amount then
    if rate > 0 then return answer(0, i, string.format('%.17g', (amount - levels[i]) / rate)) end
    return answer(0, i, 'inf')
  end
end
if has_slot then
  redis.call('HSET', KEYS[1], 'value', string.format('%d', in_flight + 1), 'expires_at', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
for i = 1, #levels do
  local j = 7 + 3 * (i - 1)
  levels[i] = levels[i] - tonumber(ARGV[j + 2])
  store_bucket(KEYS[first + i - 1], levels[i], stamps[i], tonumber(ARGV[j]), tonumber(ARGV[j + 1]), slack_ms)
end
return answer(1, -1, '0')
"""

# ARGV: now, has_slot, slot_expires_at, slot_gc_ms, has_give, capacity, rate, delta, floor, gc_slack_ms.
_RETURN_QUOTA = _STORE_BUCKET + """
local now = tonumber(ARGV[1])
local k = 1
if ARGV[2] == '1' then
  local cur = redis.call('HMGET', KEYS[1], 'value', 'expires_at')
  local value = 0
  if cur[1] and tonumber(cur[2]) > now then value = tonumber(cur[1]) end
  redis.call('HSET', KEYS[1], 'value', string.format('%d', math.max(0, value - 1)), 'expires_at', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  k = 2
end
if ARGV[5] == '1' then
  local capacity, rate = tonumber(ARGV[6]), tonumber(ARGV[7])
  local tokens, updated_at = refilled(KEYS[k], now, capacity, rate)
  tokens = math.max(tonumber(ARGV[9]), math.min(capacity, tokens + tonumber(ARGV[8])))
  store_bucket(KEYS[k], tokens, updated_at, capacity, rate, tonumber(ARGV[10]))
end
return 1
"""

# KEYS[1] lease hash; ARGV: now, holder, expires_at, gc_ms. Returns 1 if acquired or renewed.
_ACQUIRE_LEASE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'expires_at')
if cur[1] and cur[1] ~= ARGV[2] and tonumber(cur[2]) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[2], 'expires_at', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS[1] lease hash; ARGV: now, holder. Returns 1 if the live lease was the holder's and is gone.
_RELEASE_LEASE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'expires_at')
if cur[1] == ARGV[2] and tonumber(cur[2]) > tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS[1] collection hash; ARGV: record_id, expected_version ('' = any), data JSON.
# Returns {1, new_version} or {0, current_version} on conflict.
_PUT_RECORD = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local version = 0
if cur then version = tonumber(string.match(cur, '^(%d+)\\n')) end
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= version then return {0, version} end
version = version + 1
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', version) .. '\\n' .. ARGV[3])
return {1, version}
"""

# KEYS[1] collection hash; ARGV: record_id, expected_version ('' = any).
# Returns {1, version} deleted, {2, 0} absent, {0, current_version} on conflict.
_DELETE_RECORD = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local version = 0
if cur then version = tonumber(string.match(cur, '^(%d+)\\n')) end
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= version then return {0, version} end
if not cur then return {2, 0} end
redis.call('HDEL', KEYS[1], ARGV[1])
return {1, version}
"""


def _script(source: str) -> Script:
    return Script(source, hashlib.sha1(source.encode()).hexdigest())


def redact_url(url: str) -> str:
    """`url` fit for a log line: a password in the user part or in the query becomes "***".
    "redis://:s3cret@10.0.0.5:6379/0" -> "redis://:***@10.0.0.5:6379/0".

    The user part is everything up to the last "@", so a password holding "/", "#" or "?" (a generated
    token, written unencoded) is hidden whole, where urlsplit would take part of it for the path."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, hostpart = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.partition(':')[0]}:***@{hostpart}"
    base, question, query = rest.partition("?")
    if question:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in pairs):
            query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
    return f"{scheme}://{base}" + (f"?{query}" if question else "")


class RedisStateStore:
    """A `StateStore` in Redis. See `StateStore` for each method's contract.

    The store owns `client` (it closes it) and needs it built with `decode_responses=True`;
    `from_url` builds one with short timeouts. Construction does no I/O. `url` names the server in
    error messages, without its password (default: host:port/db of the client).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        clock: Clock,
        *,
        prefix: str = "kvgate:",
        gc_slack_s: float = 60.0,
        url: str | None = None,
    ) -> None:
        kwargs = client.get_connection_kwargs()
        if not kwargs.get("decode_responses"):
            raise ValueError("RedisStateStore needs a client built with decode_responses=True")
        self.url = redact_url(url) if url is not None else (
            f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}")
        self._client = client
        self._clock = clock
        self._prefix = prefix
        self._members_key = f"{prefix}members"
        self._gc_slack_s = gc_slack_s
        self._closed = False
        self._skipped = SkippedRecords(log)  # members written by a newer release
        self._put_member = client.register_script(_PUT_MEMBER)
        self._list_members = client.register_script(_LIST_MEMBERS)
        self._remove_member = client.register_script(_REMOVE_MEMBER)
        self._incr = client.register_script(_INCR)
        self._take_tokens = client.register_script(_TAKE_TOKENS)
        # Called for every admitted request: batched (redis_batch), not one round trip each.
        self._batches = ScriptBatcher(client)
        self._take_quota = _script(_TAKE_QUOTA)
        self._return_quota = _script(_RETURN_QUOTA)
        self._acquire_lease = client.register_script(_ACQUIRE_LEASE)
        self._release_lease = client.register_script(_RELEASE_LEASE)
        self._put_record = client.register_script(_PUT_RECORD)
        self._delete_record = client.register_script(_DELETE_RECORD)

    @classmethod
    def from_url(
        cls,
        url: str,
        clock: Clock,
        *,
        prefix: str = "kvgate:",
        timeout_s: float = 2.0,
        gc_slack_s: float = 60.0,
        password: str | None = None,
    ) -> RedisStateStore:
        """A store on a new client for `url` ("redis://host:port/db", "rediss://..."). Each command
        waits at most `timeout_s` for a connection or reply, and a failed connection is retried
        twice with 25-100 ms backoff before `StateStoreUnavailable` is raised. `password` is used
        when the URL carries none."""
        extra = {"password": password} if password and urlsplit(url).password is None else {}
        client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.025), retries=2),
            **extra,
        )
        return cls(client, clock, prefix=prefix, gc_slack_s=gc_slack_s, url=url)

    @contextlib.contextmanager
    def _mapped_errors(self) -> Iterator[None]:
        if self._closed:
            raise StateStoreUnavailable(f"state store {self.url} is closed")
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            raise StateStoreUnavailable(f"state store {self.url} unreachable: {err}") from err
        except redis.exceptions.RedisError as err:
            raise StateStoreError(f"state store {self.url}: {err}") from err

    def _gc_ms(self, ttl_s: float) -> int:
        return math.ceil((ttl_s + self._gc_slack_s) * 1000)

    def _key(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"

    # -- membership ------------------------------------------------------------------------------

    async def put_member(self, record: MemberRecord, ttl_s: float) -> MemberRecord:
        check_name("replica_id", record.replica_id)
        check_ttl_s(ttl_s)
        now = self._clock.wall()
        stored = dataclasses.replace(record, updated_at=now)
        envelope = f"{now + ttl_s!r}\n{json.dumps(stored.to_json())}"
        with self._mapped_errors():
            await self._put_member(
                keys=[self._members_key], args=[record.replica_id, envelope, self._gc_ms(ttl_s)]
            )
        return stored

    async def remove_member(self, replica_id: str) -> bool:
        with self._mapped_errors():
            removed = await self._remove_member(
                keys=[self._members_key], args=[replica_id, repr(self._clock.wall())]
            )
        return removed == 1

    async def list_members(self, model: str | None = None) -> list[MemberRecord]:
        with self._mapped_errors():
            envelopes = await self._list_members(
                keys=[self._members_key], args=[repr(self._clock.wall())]
            )
        members = []
        for envelope in envelopes:
            # An envelope is "<expires_at>\n<json>"; the script already dropped the expired ones.
            raw = json.loads(envelope.partition("\n")[2])
            try:
                members.append(MemberRecord.from_json(raw))
            except NewerSchema as exc:  # a replica of a newer release, mid-upgrade: not routable by this one
                self._skipped.newer("members", str(raw.get("replica_id")), exc)
        return sorted(
            (m for m in members if model is None or m.model == model), key=lambda m: m.replica_id
        )

    # -- counters --------------------------------------------------------------------------------

    async def incr(self, key: str, delta: int = 1, *, ttl_s: float) -> int:
        check_name("key", key)
        check_delta(delta)
        check_ttl_s(ttl_s)
        now = self._clock.wall()
        args = [repr(now), str(delta), repr(now + ttl_s), self._gc_ms(ttl_s)]
        with self._mapped_errors():
            return int(await self._incr(keys=[self._key("counter", key)], args=args))

    async def get_counter(self, key: str) -> int:
        with self._mapped_errors():
            value, expires_at = await self._client.hmget(
                self._key("counter", key), ["value", "expires_at"]
            )
        if value is None or float(expires_at) <= self._clock.wall():
            return 0
        return int(value)

    # -- rate limiting ---------------------------------------------------------------------------

    async def take_tokens(
        self, key: str, capacity: float, refill_per_s: float, cost: float = 1.0
    ) -> TokenBucketResult:
        check_name("key", key)
        check_bucket_args(capacity, refill_per_s, cost)
        with self._mapped_errors():
            allowed, remaining, retry_after_s = await self._take_tokens(
                keys=[self._key("bucket", key)], args=self._bucket_args(capacity, refill_per_s, cost)
            )
        return TokenBucketResult(allowed == 1, float(remaining), float(retry_after_s))

    async def take_quota(self, slot: Slot | None, takes: Sequence[BucketTake]) -> QuotaResult:
        now = self._clock.wall()
        keys = [self._key("counter", slot.key)] if slot is not None else []
        args: list[str | int] = [repr(now), "1" if slot is not None else "0"]
        args += ([str(slot.limit), repr(now + slot.ttl_s), self._gc_ms(slot.ttl_s)] if slot is not None
                 else ["0", "0", "0"])
        args.append(math.ceil(self._gc_slack_s * 1000))
        for take in takes:
            keys.append(self._key("bucket", take.key))
            args += [repr(float(take.capacity)), repr(float(take.refill_per_s)), repr(float(take.amount))]
        with self._mapped_errors():
            allowed, refused, retry_after_s, *levels = await self._batches.call(self._take_quota, keys, args)
        return QuotaResult(allowed == 1, None if refused == -1 else int(refused),
                           tuple(float(level) for level in levels), float(retry_after_s))

    async def return_quota(self, slot: Slot | None, give: BucketGive | None) -> None:
        now = self._clock.wall()
        keys = [self._key("counter", slot.key)] if slot is not None else []
        args: list[str | int] = [repr(now), "1" if slot is not None else "0"]
        args += [repr(now + slot.ttl_s), self._gc_ms(slot.ttl_s)] if slot is not None else ["0", "0"]
        if give is not None:
            keys.append(self._key("bucket", give.key))
            args += ["1", *map(repr, map(float, (give.capacity, give.refill_per_s, give.delta, give.floor)))]
        else:
            args += ["0", "0", "0", "0", "0"]
        args.append(math.ceil(self._gc_slack_s * 1000))
        with self._mapped_errors():
            await self._batches.call(self._return_quota, keys, args)

    def _bucket_args(self, capacity: float, refill_per_s: float, amount: float) -> list[str | int]:
        numbers = [self._clock.wall(), float(capacity), float(refill_per_s), float(amount)]
        return [*map(repr, numbers), math.ceil(self._gc_slack_s * 1000)]

    # -- leases ----------------------------------------------------------------------------------

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        check_name("lease name", name)
        check_name("holder", holder)
        check_ttl_s(ttl_s)
        now = self._clock.wall()
        args = [repr(now), holder, repr(now + ttl_s), self._gc_ms(ttl_s)]
        with self._mapped_errors():
            return await self._acquire_lease(keys=[self._key("lease", name)], args=args) == 1

    async def release_lease(self, name: str, holder: str) -> bool:
        args = [repr(self._clock.wall()), holder]
        with self._mapped_errors():
            return await self._release_lease(keys=[self._key("lease", name)], args=args) == 1

    async def lease_holder(self, name: str) -> str | None:
        with self._mapped_errors():
            holder, expires_at = await self._client.hmget(
                self._key("lease", name), ["holder", "expires_at"]
            )
        if holder is None or float(expires_at) <= self._clock.wall():
            return None
        return holder

    # -- durable records -------------------------------------------------------------------------

    async def put_record(
        self,
        collection: str,
        record_id: str,
        data: Mapping[str, JSONValue],
        expected_version: int | None = None,
    ) -> int:
        check_name("collection", collection)
        check_name("record_id", record_id)
        check_expected_version(expected_version)
        expected = "" if expected_version is None else str(expected_version)
        args = [record_id, expected, encode_record_data(data)]
        with self._mapped_errors():
            ok, version = await self._put_record(keys=[self._key("records", collection)], args=args)
        if ok == 0:
            raise VersionConflict(collection, record_id, expected_version or 0, int(version))
        return int(version)

    async def get_record(self, collection: str, record_id: str) -> StoredRecord | None:
        with self._mapped_errors():
            envelope = await self._client.hget(self._key("records", collection), record_id)
        return None if envelope is None else self._record(collection, record_id, envelope)

    async def delete_record(
        self, collection: str, record_id: str, expected_version: int | None = None
    ) -> bool:
        check_expected_version(expected_version)
        expected = "" if expected_version is None else str(expected_version)
        with self._mapped_errors():
            status, version = await self._delete_record(
                keys=[self._key("records", collection)], args=[record_id, expected]
            )
        if status == 0:
            raise VersionConflict(collection, record_id, expected_version or 0, int(version))
        return status == 1

    async def list_records(self, collection: str) -> list[StoredRecord]:
        with self._mapped_errors():
            envelopes = await self._client.hgetall(self._key("records", collection))
        return [self._record(collection, rid, env) for rid, env in sorted(envelopes.items())]

    @staticmethod
    def _record(collection: str, record_id: str, envelope: str) -> StoredRecord:
        version, _, body = envelope.partition("\n")
        return StoredRecord(collection, record_id, int(version), decode_record_data(body))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._batches.close()
        with contextlib.suppress(redis.exceptions.RedisError, OSError):
            await self._client.aclose()
