"""Usage accounting: per tenant and model, what each finished inference request cost in requests and tokens.

Every request that passed the gateway's checks and went to the proxy ends here once (`UsageMeter.metering`, around
the proxy's forward in `router.handlers`), whatever its end: answered, a replica's error passed through, a stream
cut short, no capacity, the client gone. Its end is counted three ways:
- in /metrics, `kvgate_router_tenant_requests_total{tenant, model, outcome}` and
  `kvgate_router_tenant_tokens_total{tenant, model, kind}`: `tenant` is a registry Tenant's name or OPEN_TENANT,
  `model` a registry model or adapter name (the request's, resolved), `outcome` one of OUTCOMES, `kind` one of
  prompt, cached, completion: every label bounded by the registry, never a key or anything a client typed freely;
- in /admin/stats under `usage` (`UsageMeter.totals`), for the dashboard;
- as one JSON line in the usage log when one is set (`UsageLog`), for a billing job: appended by a thread of its
  own, so the request path never waits on the disk.

Tokens are the replica's `usage` (a stream reports it only with `stream_options.include_usage`); a request whose
answer said none counts no tokens and its line says `"usage_reported": false`. No dollar figure is made here: a
GPU-hour is spent whether or not requests come, so the cost of a request is a share of the fleet's spend, which the
billing job splits by these token counts (README, "Usage accounting").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from kvgate.clock import Clock
from kvgate.openai_wire import ApiError
from kvgate.registry.schema import TenantDoc
from kvgate.router.metrics import TOKEN_KINDS, RouterMetrics
from kvgate.router.outcomes import TokenUsage
from kvgate.router.proxy import STREAM_OUTCOME_KEY, USAGE_KEY
from kvgate.router.usage_log import UsageLog

# The `tenant` of a request on an open gateway (no Tenant declared): no registry name starts with "_".
OPEN_TENANT = "_open"
# How a request ended (the `outcome` label): every one but "success" is an error for the tenant.
OUTCOMES = ("success", "upstream_4xx", "upstream_5xx", "stream_error", "gateway_error", "client_gone")


@dataclass(frozen=True)
class UsageRecord:
    """One finished request, as the usage log writes it (one JSON object a line): never a key or prompt text."""

    ts: float  # unix seconds when it ended
    request_id: str  # its X-Request-Id
    tenant: str  # a Tenant's name, or OPEN_TENANT
    model: str  # the registry model or adapter it named
    outcome: str  # one of OUTCOMES
    status: int | None  # the HTTP status the client got; None when the client went away first
    usage_reported: bool  # whether the replica's answer reported usage; the tokens are 0 when it did not
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, served from the replica's prefix cache (0 when it does not say)
    completion_tokens: int

    @classmethod
    def of(cls, usage: TokenUsage | None, **ended: Any) -> UsageRecord:
        """The record of a request that ended as `ended` says (ts, request_id, tenant, model, outcome, status)
        with the replica's `usage`, None when its answer reported none."""
        if usage is None:
            return cls(**ended, usage_reported=False, prompt_tokens=0, cached_tokens=0, completion_tokens=0)
        return cls(**ended, usage_reported=True, prompt_tokens=usage.prompt_tokens,
                   cached_tokens=usage.cached_tokens or 0, completion_tokens=usage.completion_tokens)

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def outcome_of(response: web.StreamResponse | None, error: BaseException | None) -> tuple[str, int | None]:
    """(outcome, status) of a request the proxy served: `response` its answer (with how its relayed stream ended,
    when it was one: `proxy.STREAM_OUTCOME_KEY`), `error` what the proxy raised instead."""
    stream_outcome = response.get(STREAM_OUTCOME_KEY) if response is not None else None
    if isinstance(error, ApiError):  # no replica could answer: 502, 503, 504
        return "gateway_error", error.status
    if error is not None or response is None:  # cancelled: the client went away
        return "client_gone", None
    if stream_outcome is not None and stream_outcome != "success":
        return ("client_gone", None) if stream_outcome == "client_gone" else ("stream_error", response.status)
    if response.status >= 500:
        return "upstream_5xx", response.status
    return ("upstream_4xx" if response.status >= 400 else "success"), response.status


def answer_code(response: web.StreamResponse | None, error: BaseException | None) -> str:
    """How an inference request ended for its client, `kvgate_router_answers_total{code}` (metrics.ANSWER_CODES):
    `response` what the handler returned, `error` what it raised instead (a refusal, the client's cancellation)."""
    if isinstance(error, ApiError | web.HTTPException):
        status = error.status
    elif isinstance(error, asyncio.CancelledError | ConnectionResetError):
        return "client_gone"
    elif error is not None or response is None:
        return "5xx"  # a bug: the error middleware answers 500
    else:
        stream_outcome = response.get(STREAM_OUTCOME_KEY)
        if stream_outcome == "client_gone":
            return "client_gone"
        if stream_outcome not in (None, "success"):
            return "stream_error"
        status = response.status
    return "2xx" if status < 400 else "4xx" if status < 500 else "5xx"


def tenant_label(tenant: TenantDoc | None) -> str:
    """The `tenant` of a request: its Tenant's name, OPEN_TENANT on an open gateway."""
    return tenant.metadata.name if tenant is not None else OPEN_TENANT


class Metered:
    """One request's metering: its handler sets `response` to the proxy's answer."""

    response: web.StreamResponse | None = None


class UsageMeter:
    """Counts each finished request into the tenant series, the /admin/stats totals and the usage log (if any)."""

    def __init__(self, metrics: RouterMetrics, clock: Clock, usage_log: UsageLog | None = None) -> None:
        self._metrics = metrics
        self._clock = clock
        self.usage_log = usage_log
        # (tenant, model) -> requests, errors and tokens since this gateway started, for /admin/stats.
        self._totals: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)

    @contextlib.contextmanager
    def metering(self, tenant: TenantDoc | None, model: str, request_id: str) -> Iterator[Metered]:
        """Around the proxy's forward of a request by `tenant` (None: an open gateway) naming `model` (a registry
        model or adapter): the block sets the response on the `Metered` it yields; whatever the block raises (the
        proxy's ApiError, the client's cancellation) is counted too, then raised on."""
        metered = Metered()
        error: BaseException | None = None
        try:
            yield metered
        except BaseException as exc:
            error = exc
            raise
        finally:
            response = metered.response
            outcome, status = outcome_of(response, error)
            self.record(UsageRecord.of(response.get(USAGE_KEY) if response is not None else None,
                                       ts=self._clock.wall(), request_id=request_id, tenant=tenant_label(tenant),
                                       model=model, outcome=outcome, status=status))

    def record(self, record: UsageRecord) -> None:
        """Count `record` everywhere; never blocks (the log's writer takes it from a queue)."""
        key = (record.tenant, record.model)
        self._metrics.tenant_requests.labels(record.tenant, record.model, record.outcome).inc()
        totals = self._totals[key]
        totals["requests"] += 1
        totals["errors"] += record.outcome != "success"
        if record.usage_reported:
            counts = (record.prompt_tokens, record.cached_tokens, record.completion_tokens)
            for kind, count in zip(TOKEN_KINDS, counts, strict=True):
                self._metrics.tenant_tokens.labels(record.tenant, record.model, kind).inc(count)
                totals[f"{kind}_tokens"] += count
        if self.usage_log is not None:
            self.usage_log.append(record.as_json())

    def totals(self) -> dict[str, dict[str, dict[str, int]]]:
        """/admin/stats' `usage`: tenant -> model -> requests, errors, prompt/cached/completion tokens."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (tenant, model), counts in sorted(self._totals.items()):
            out.setdefault(tenant, {})[model] = {
                name: counts[name] for name in
                ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens")}
        return out

    async def close(self) -> None:
        """Write out what the log still holds and close it (at the app's cleanup)."""
        if self.usage_log is not None:
            await asyncio.to_thread(self.usage_log.close)

