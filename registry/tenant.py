"""The `Tenant` kind: who may call the gateway (an API key, by its keyed hash), which models it may use, and
its rate limits.

Keys are stored as HMAC-SHA256(server secret, key), hex: never the key, and never a plain hash. An unsalted
SHA-256 of a key can be checked offline against guesses by anyone who reads the registry (a git repository, a
ConfigMap); the HMAC cannot be checked without the secret, which lives only in the gateways' environment
(`KEY_SECRET_ENV`). `key_hmac` is the one place the hash is computed: `kvgate keys` and the gateway share it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re

from pydantic import Field, field_validator, model_validator

from kvgate.registry.strict import FieldProblem, Strict

# The environment variable holding the server secret that API keys are hashed with (gateways and `kvgate keys`).
KEY_SECRET_ENV = "KVGATE_KEY_SECRET"
# A secret shorter than this is refused: HMAC-SHA256's key is as strong as its entropy, and 32 characters of
# `secrets.token_urlsafe` (~190 bits) is more than the 128 bits that make guessing it pointless.
MIN_KEY_SECRET_CHARS = 32
_HMAC_HEX = re.compile(r"[0-9a-f]{64}")
ALL_MODELS = "*"


def key_hmac(secret: bytes, api_key: str) -> str:
    """The registry's form of `api_key`: hex HMAC-SHA256 under the server secret."""
    return hmac.new(secret, api_key.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def key_secret_problem(secret: str | None) -> str | None:
    """Why `secret` (the value of KEY_SECRET_ENV) cannot hash keys, or None when it can."""
    if not secret:
        return f"{KEY_SECRET_ENV} is not set"
    if len(secret) < MIN_KEY_SECRET_CHARS:
        return (f"{KEY_SECRET_ENV} is {len(secret)} characters; use at least {MIN_KEY_SECRET_CHARS} random ones, "
                f"e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return None


class StoreOutage(str, enum.Enum):
    """What a tenant's limits do while the shared state store cannot be reached."""

    OPEN = "open"  # each gateway counts on its own: N gateways let up to N times the limits through
    CLOSED = "closed"  # refuse the tenant's requests (503, Retry-After) until the store answers


class RateLimits(Strict):
    requests_per_minute: float | None = Field(
        default=None, ge=1, description="Requests admitted per minute, over all gateways; at most burst_s of it "
                                        "(at least one request) at once.")
    tokens_per_minute: float | None = Field(
        default=None, ge=1, description="Prompt plus completion tokens per minute: the prompt's estimate plus "
                                        "max_tokens are reserved at admission, and settled from the answer's usage.")
    burst_s: float = Field(
        default=3.0, gt=0, le=60,
        description="How much of each per-minute limit may be sent at once, in seconds of it: 3 lets a tenant "
                    "idle for 3 s send 3 s worth (at least one request), so over any minute it gets at most the "
                    "limit plus 5%; 60 lets an idle tenant send a whole minute's worth at once (up to twice the "
                    "limit in its first minute).")
    max_concurrent_requests: int | None = Field(default=None, ge=1, description="Requests in flight at once, over "
                                                                                "all gateways.")
    on_store_outage: StoreOutage = Field(
        default=StoreOutage.OPEN, description="While the state store is unreachable: 'open' (each gateway holds "
                                              "the limits on its own) or 'closed' (refuse with 503).")

    @field_validator("requests_per_minute", "tokens_per_minute", mode="before")
    @classmethod
    def _at_least_one(cls, value: object) -> object:
        # Under 1 a minute is a rate nobody means (one request an hour is not what a per-minute limit is for).
        # (Field's ge=1 still refuses what is not a number, and feeds the JSON Schema.)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"is {value:g} per minute; use at least 1, or leave it unset for none")
        return value


class TenantSpec(Strict):
    api_key_hmac: str = Field(description=f"Hex HMAC-SHA256 of the tenant's API key under ${KEY_SECRET_ENV}; "
                                          "`kvgate keys create --tenant NAME` makes a key and prints it.")
    models: tuple[str, ...] = Field(min_length=1, description="Models and adapters it may use, each by its own "
                                                              "name (a model does not bring its adapters); '*' "
                                                              "means all.")
    rate_limits: RateLimits = Field(default_factory=RateLimits)
    weight: float = Field(
        default=1.0, gt=0, le=1000,
        description="Its share of a saturated model against the other tenants waiting at the same priority: "
                    "weighted fair queuing gives a tenant of weight 2 twice the requests of one of weight 1.")
    priority: int = Field(
        default=0, ge=-100, le=100,
        description="The priority of its requests while a model is saturated: a higher one is served first, a "
                    "lower one shed first when the wait would break the model's TTFT SLO.")
    max_priority: int | None = Field(
        default=None, ge=-100, le=100,
        description="The highest priority its requests may ask for in the x-kvgate-priority header (one above "
                    "is refused with 400); unset: its own priority. Any request may ask for a lower one.")

    @model_validator(mode="after")
    def _max_priority_at_least_its_own(self) -> TenantSpec:
        if self.max_priority is not None and self.max_priority < self.priority:
            raise FieldProblem("max_priority", f"is {self.max_priority}, below the tenant's own priority "
                                               f"{self.priority}; leave it unset, or at least {self.priority}")
        return self

    def priority_of(self, asked: int | None) -> int:
        """The priority a request of this tenant gets when it asks for `asked` (None: its own); raises
        ValueError for one above what it may ask for."""
        if asked is None:
            return self.priority
        highest = self.priority if self.max_priority is None else self.max_priority
        if asked > highest:
            raise ValueError(f"priority {asked} is above the highest this key may ask for ({highest})")
        return asked

    @model_validator(mode="before")
    @classmethod
    def _no_plain_hash(cls, data: object) -> object:
        if isinstance(data, dict) and "api_key_sha256" in data:
            raise FieldProblem("api_key_sha256", f"unsalted SHA-256 key hashes are no longer accepted (anyone who "
                               f"reads the registry can test guesses against them); set {KEY_SECRET_ENV} and "
                               "replace this line with the one `kvgate keys hash --tenant NAME` prints for the "
                               "same key (read from stdin), or issue a new key with `kvgate keys create`")
        return data

    @field_validator("api_key_hmac")
    @classmethod
    def _hmac_hex(cls, value: str) -> str:
        value = value.strip().lower()
        if not _HMAC_HEX.fullmatch(value):
            raise ValueError("is not a hex HMAC-SHA256 (64 hex digits); store the key's keyed hash, never the key: "
                             "`kvgate keys create --tenant NAME` prints it")
        return value

    def allows(self, served_name: str) -> bool:
        """May this tenant use `served_name` (a model or an adapter, as a request's `model` names it)?"""
        return ALL_MODELS in self.models or served_name in self.models
