"""`kvgate autoscaler --metrics-port PORT`: the autoscaler's /metrics (for Prometheus) and /health (for a probe).

- `/metrics` serves `autoscaler.metrics`' series. With `$KVGATE_METRICS_TOKEN` set it needs
  `Authorization: Bearer <token>` (the gateway's metrics token: one Prometheus secret scrapes both).
- `/health` answers 200 while the control loop runs (leader or standby: a standby is healthy), 503 once it ended.
- **Secure by default**: beyond a loopback `--metrics-host` the autoscaler refuses to start without a metrics
  token, unless told `--insecure-open-metrics`, which it says as a WARNING at start.

`metrics_access` decides (pure); `metrics_app` is the aiohttp shell.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvgate.exposition import render
from kvgate.openai_wire import ApiError, error_response, is_loopback_host, require_bearer

METRICS_TOKEN_ENV = "KVGATE_METRICS_TOKEN"  # the gateway's name for it too (router.operator_access)
INSECURE_FLAG = "--insecure-open-metrics"


@dataclass(frozen=True)
class MetricsAccess:
    """How the metrics listener may start: its token, or why it must not (`refusal`), and a line to log."""

    token: str | None = field(default=None, repr=False)
    refusal: str | None = None
    notice: tuple[int, str] | None = None


def metrics_access(host: str, token: str | None, insecure_open: bool) -> MetricsAccess:
    """The listener on `host` with `token` (from the environment; None or blank: none)."""
    token = (token or "").strip() or None
    if token is not None:
        return MetricsAccess(token=token)
    if is_loopback_host(host):
        return MetricsAccess(notice=(logging.INFO, f"/metrics on {host} is open (loopback only); set "
                                                    f"${METRICS_TOKEN_ENV} to require a token"))
    if not insecure_open:
        return MetricsAccess(refusal=f"--metrics-host {host} is beyond loopback and ${METRICS_TOKEN_ENV} is not "
                                     f"set: /metrics would be open to the network. Set the token, listen on "
                                     f"127.0.0.1, or pass {INSECURE_FLAG} to serve it open anyway")
    return MetricsAccess(notice=(logging.WARNING, f"/metrics on {host} is OPEN to the network without a token "
                                                   f"({INSECURE_FLAG})"))


def metrics_app(registry: CollectorRegistry, token: str | None, running: Callable[[], bool]) -> web.Application:
    """/metrics (behind `token` when set) and /health (200 while `running()`)."""
    async def metrics(request: web.Request) -> web.Response:
        if token is not None:
            try:
                require_bearer(request.headers.get("Authorization"), [token], name="metrics token",
                               code="invalid_metrics_token")
            except ApiError as exc:
                return error_response(exc)
        body, content_type = render(registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(request: web.Request) -> web.Response:
        if running():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "stopped"}, status=503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app
