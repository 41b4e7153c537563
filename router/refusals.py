"""Answers the gateway writes itself instead of a replica's, counted in /metrics by reason:
`kvgate_router_refused_requests_total{model, reason, status, tenant}` (`RouterMetrics.refused_requests`).

Every label is bounded, whatever clients send: `reason` comes from the fixed set below, `status` is one of
the HTTP statuses the gateway answers with, `model` is a base model the registry declares (the request
named it or one of its adapters) or NO_MODEL, so naming made-up models adds no series, and `tenant` is the
registry Tenant whose key the request carried, `_open` on an open gateway, or NO_TENANT before (or without) a
valid key. A replica's own error
answers pass through uncounted here (`kvgate_router_requests_total{outcome="upstream_4xx"}` counts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from aiohttp import web

from kvgate.openai_wire import ApiError
from kvgate.router.metrics import NO_MODEL
from kvgate.router.request_caps import OVER_CAP_CODES

# Set on an inference request once its model resolved to a registry model: the refusal's `model` label.
REFUSAL_MODEL_KEY = web.RequestKey("kvgate_refusal_model", str)
# The `model` label before (or without) a declared model (defined with the metrics): no registry name starts with
# "_", so it never shares a model's series.
# Set on a request once its key named a tenant (or the gateway is open): the refusal's `tenant` label.
REFUSAL_TENANT_KEY = web.RequestKey("kvgate_refusal_tenant", str)
NO_TENANT = "_none"

# Reasons that an error's code tells apart within one status; every other answer is named by its status.
_REASON_OF_CODE: Mapping[str, str] = MappingProxyType({
    "invalid_json": "bad_json",  # not JSON, nested too deeply, a lone surrogate
    "invalid_body": "bad_body",  # a Content-Encoding that does not decode
    "model_not_found": "unknown_model",
    "draining": "draining",  # this gateway is shutting down
    "model_overloaded": "shed",  # fair queuing: the wait would break the model's TTFT SLO (router.flow_control)
    **{code: "over_cap" for code in OVER_CAP_CODES},  # the model's `limits`
})
_REASON_OF_STATUS: Mapping[int, str] = MappingProxyType({
    400: "invalid_request",  # a missing or mistyped field
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",  # no such path
    405: "method",
    408: "body_timeout",
    413: "too_large",
    429: "rate_limited",
    500: "internal_error",
    502: "upstream_unavailable",
    503: "no_capacity",
    504: "upstream_timeout",
})
REASONS = frozenset(_REASON_OF_CODE.values()) | frozenset(_REASON_OF_STATUS.values()) | {"other"}


def refusal_labels(error: ApiError, model: str, tenant: str = NO_TENANT) -> tuple[str, str, str, str]:
    """(model, reason, status, tenant) of a refusal; `model` and `tenant` as set under REFUSAL_MODEL_KEY and
    REFUSAL_TENANT_KEY, else NO_MODEL and NO_TENANT."""
    reason = _REASON_OF_CODE.get(error.code or "") or _REASON_OF_STATUS.get(error.status, "other")
    return model, reason, str(error.status), tenant
