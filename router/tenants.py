"""API keys at the gateway: which Tenant a request comes from, and which names it may see and use.

With no Tenant in the registry the gateway is open (the single-box default). With tenants, every inference
request and `/v1/models` needs `Authorization: Bearer <key>` (the OpenAI SDK's `api_key`), looked up by its
HMAC under the server secret (`registry.tenant`): one HMAC and one dict lookup per request, the dict built
once per registry snapshot. A tenant sees and uses only the names it lists; another name is answered exactly
as a name that does not exist, so a tenant cannot learn what others run.

The key itself is never kept, logged or echoed: a refusal says only that the key is missing or wrong.
"""

from __future__ import annotations

import enum
import hmac
import logging
from collections.abc import Mapping

from kvgate.openai_wire import ApiError, bad_request, bearer_credential
from kvgate.registry.schema import TenantDoc
from kvgate.registry.snapshot import Snapshot
from kvgate.registry.tenant import KEY_SECRET_ENV, key_hmac, key_secret_problem
from kvgate.router.fair_queue import Flow
from kvgate.router.usage import OPEN_TENANT

log = logging.getLogger(__name__)



class KeySecretMissing(Exception):
    """The registry declares tenants but the gateway has no usable key secret: it must not start."""


def read_key_secret(environ: Mapping[str, str]) -> bytes | None:
    """The server secret from KEY_SECRET_ENV, or None when unset. Raises KeySecretMissing when it is set but too
    weak to hash keys with."""
    value = environ.get(KEY_SECRET_ENV, "")
    if not value:
        return None
    problem = key_secret_problem(value)
    if problem is not None:
        raise KeySecretMissing(problem)
    return value.encode()


def check_can_authenticate(snapshot: Snapshot, secret: bytes | None) -> None:
    """Raises KeySecretMissing, with what to do, when `snapshot` declares tenants and there is no secret."""
    if snapshot.tenants and secret is None:
        raise KeySecretMissing(
            f"the registry declares {len(snapshot.tenants)} Tenant(s) ({', '.join(sorted(snapshot.tenants))}), "
            f"whose API keys are checked against HMACs under {KEY_SECRET_ENV}, which is not set; set it to the "
            "secret the keys were created with (`kvgate keys create`)")


def key_secret_for(snapshot: Snapshot, environ: Mapping[str, str]) -> bytes | None:
    """The secret a gateway serving `snapshot` checks keys with: what `router.main` and `kvgate up` call before
    they start. Raises KeySecretMissing (one line: print it and exit) when it is set but weak, or unset while
    the registry declares tenants."""
    secret = read_key_secret(environ)
    check_can_authenticate(snapshot, secret)
    return secret


def invalid_api_key(message: str) -> ApiError:
    """401 in OpenAI's shape; never names the key that was sent."""
    return ApiError(401, message, type="AuthenticationError", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


class Access(enum.Enum):
    """How the gateway admits clients under the registry in force."""

    OPEN = "open"  # no Tenant declared: anyone may use every model
    KEYS = "keys"  # tenants declared: a key names the tenant
    LOCKED = "locked"  # tenants declared but no secret to check keys with: everyone gets 401


def access_of(snapshot: Snapshot, secret: bytes | None) -> Access:
    if not snapshot.tenants:
        return Access.OPEN
    return Access.KEYS if secret is not None else Access.LOCKED


class TenantAccess:
    """Authenticates requests against the registry in force; says how clients are admitted at start and
    whenever a reload changes it."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._access: Access | None = None

    def authenticate(self, snapshot: Snapshot, authorization: str) -> TenantDoc | None:
        """The tenant whose key `authorization` carries; None when the gateway is open. Raises ApiError 401
        when tenants are declared and the key is missing or matches none."""
        if not snapshot.tenants:
            return None
        key = bearer_credential(authorization)
        if key is None:
            raise invalid_api_key("You didn't provide an API key: send it as 'Authorization: Bearer <key>'.")
        if self._secret is None:
            raise invalid_api_key("Incorrect API key provided.")
        digest = key_hmac(self._secret, key)
        tenant = snapshot.tenant_for_key_hmac(digest)
        # The dict is keyed by HMACs the client cannot steer without the secret, so the lookup's timing tells
        # it nothing; the final comparison is constant-time all the same.
        if tenant is None or not hmac.compare_digest(tenant.spec.api_key_hmac, digest):
            raise invalid_api_key("Incorrect API key provided.")
        return tenant

    def note_registry(self, snapshot: Snapshot) -> None:
        """Log how clients are admitted, once at start and again only when a reload changes it."""
        access = access_of(snapshot, self._secret)
        if access is self._access:
            return
        self._access = access
        if access is Access.OPEN:
            log.info("no Tenant declared: the gateway is open, every client may use every model without a key")
        elif access is Access.KEYS:
            log.info("%d Tenant(s) declared: inference and /v1/models need an API key", len(snapshot.tenants))
        else:
            log.error("the registry now declares Tenant(s) but %s is not set: every request gets 401 until it "
                      "is set and the gateway restarted", KEY_SECRET_ENV)


def visible_names(snapshot: Snapshot, tenant: TenantDoc | None) -> list[str]:
    """The names `tenant` may put in `model` (every servable name on an open gateway), sorted."""
    names = snapshot.served_names()
    return names if tenant is None else [name for name in names if tenant.spec.allows(name)]


# The header a request asks for its priority in, up to its tenant's `max_priority` (`router.flow_control`).
PRIORITY_HEADER = "x-kvgate-priority"


def flow_of(tenant: TenantDoc | None, asked: str | None) -> Flow:
    """Whose a request is for fair queuing: its tenant, the priority it asked for in PRIORITY_HEADER within
    what the tenant may, and the tenant's weight. On an open gateway every request is one flow at priority 0:
    nobody is there to grant a priority, so the header is ignored. Raises ApiError 400 for a header that is not
    a whole number or asks for more than the tenant may."""
    if tenant is None:
        return Flow(OPEN_TENANT)
    try:
        priority = tenant.spec.priority_of(None if asked is None else int(asked.strip()))
    except ValueError as exc:
        message = str(exc) if asked is not None and asked.strip().lstrip("+-").isdigit() else (
            f"{PRIORITY_HEADER} must be a whole number, e.g. 0 or -1")
        raise bad_request(message, code="invalid_priority") from None
    return Flow(tenant.metadata.name, priority, tenant.spec.weight)
