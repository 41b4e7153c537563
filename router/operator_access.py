"""Who may read the gateway's operator endpoints: `/admin/*` (the dashboard's data) and `/metrics`.

- **Admin token.** With `$KVGATE_ADMIN_TOKEN` set, every path under `/admin/` (known or not) needs
  `Authorization: Bearer <token>`, and so does `/metrics`; anything else is a 401 (`invalid_admin_token`).
- **Metrics token.** With `$KVGATE_METRICS_TOKEN` set, `/metrics` takes it (or the admin token): Prometheus
  then scrapes with a credential that opens nothing else, so a leaked scrape config does not hand out the
  routing decisions, replica placement and autoscaler status that `/admin/stats` holds. Without it, one token
  guards both, which is the least an operator must set.
- **Secure by default.** Without an admin token the operator endpoints are open, which `kvgate router` and
  `kvgate up` allow only on a loopback `--host` (the single box). Beyond loopback they refuse to start unless
  told `--insecure-open-admin`, which they say as a WARNING at start.
- **Out of `ps`.** Tokens come from the environment; a command-line value would show in every process listing.
  `--admin-token` still works, with a deprecation WARNING. Whitespace around a token is dropped (a Secret made
  from a file often ends in a newline, which no HTTP header can carry).

The decisions are pure functions (`plan_access`, `tokens_for`); `operator_auth` is the aiohttp middleware that
applies them, with the constant-time check shared with the engine (`kvgate.openai_wire.require_bearer`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from kvgate.openai_wire import is_loopback_host, require_bearer

ADMIN_TOKEN_ENV = "KVGATE_ADMIN_TOKEN"
METRICS_TOKEN_ENV = "KVGATE_METRICS_TOKEN"
INSECURE_FLAG = "--insecure-open-admin"
METRICS_PATH = "/metrics"
ADMIN_PREFIX = "/admin"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class AccessPlan:
    """What a gateway about to start is told about its operator endpoints: the tokens, whether it must refuse to
    start (`refusal`, the message to exit with), and the (logging level, message) lines to log at start."""

    admin_token: str | None = field(default=None, repr=False)
    metrics_token: str | None = field(default=None, repr=False)
    refusal: str | None = None
    notices: tuple[tuple[int, str], ...] = ()


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `kvgate router` and `kvgate up` share for their operator endpoints."""
    parser.add_argument("--admin-token", default=None, metavar="TOKEN",
                        help=f"DEPRECATED (the value shows in `ps`): set ${ADMIN_TOKEN_ENV} in the environment "
                             f"instead. The token /admin/*, the dashboard's data and /metrics require; "
                             f"${METRICS_TOKEN_ENV} adds a token for /metrics alone (for Prometheus)")
    parser.add_argument(INSECURE_FLAG, action="store_true",
                        help=f"serve /admin/* and /metrics without a token on a --host beyond loopback, which is "
                             f"refused otherwise (logged as a WARNING); set ${ADMIN_TOKEN_ENV} instead")


def plan_access(host: str, *, flag_token: str | None, environ: Mapping[str, str], insecure_open: bool) -> AccessPlan:
    """The operator endpoints' tokens and start-up verdict for a gateway listening on `host`. The admin token is
    `flag_token` (the deprecated --admin-token) or else $KVGATE_ADMIN_TOKEN; empty or blank counts as unset."""
    admin_token = (flag_token or environ.get(ADMIN_TOKEN_ENV) or "").strip() or None
    metrics_token = (environ.get(METRICS_TOKEN_ENV) or "").strip() or None
    notices = []
    if flag_token:
        notices.append((logging.WARNING, f"--admin-token is deprecated: its value shows in `ps` and "
                                         f"/proc/PID/cmdline; set ${ADMIN_TOKEN_ENV} in the environment instead"))
    loopback = is_loopback_host(host)
    if admin_token is None and not loopback and not insecure_open:
        return AccessPlan(refusal=(
            f"refusing to listen on {host} with /admin/* (the dashboard's data) open to anyone who reaches it: "
            f"set ${ADMIN_TOKEN_ENV} in the environment (clients send 'Authorization: Bearer <token>'), listen on "
            f"127.0.0.1, or pass {INSECURE_FLAG} to serve them without a token anyway"))
    metrics_guards = [f"${METRICS_TOKEN_ENV}"] * bool(metrics_token) + ["the admin token"] * bool(admin_token)
    summary = (f"/admin/* and the dashboard's data need {_guards(['the admin token'] * bool(admin_token))}; "
               f"/metrics needs {_guards(metrics_guards)}")
    if admin_token is None and not loopback:
        notices.append((logging.WARNING, f"INSECURE ({INSECURE_FLAG}): listening on {host}, the operator endpoints "
                                         f"are reachable from the network: {summary}. Set ${ADMIN_TOKEN_ENV} instead"))
    else:
        ignored = f" ({INSECURE_FLAG} is ignored: there is a token)" if insecure_open and admin_token else ""
        notices.append((logging.INFO, summary + ignored))
    return AccessPlan(admin_token, metrics_token, None, tuple(notices))


def plan_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> AccessPlan:
    """`plan_access` for parsed arguments with `--host` and the flags of `add_access_arguments`."""
    return plan_access(args.host, flag_token=args.admin_token, environ=environ, insecure_open=args.insecure_open_admin)


def refused_to_start(plan: AccessPlan, prog: str) -> bool:
    """Say the plan's refusal, if any, on stderr as one line `PROG: ...`; True when the command must exit (2)."""
    if plan.refusal:
        print(f"{prog}: {plan.refusal}", file=sys.stderr)
    return plan.refusal is not None


def log_notices(plan: AccessPlan, log: logging.Logger) -> None:
    for level, message in plan.notices:
        log.log(level, message)


def _guards(names: list[str]) -> str:
    return " or ".join(names) if names else "no token (OPEN)"


def tokens_for(path: str, admin_token: str | None, metrics_token: str | None) -> dict[str, str]:
    """{what the token is called: token} for the tokens any one of which a request for `path` must carry as a
    Bearer token; empty when the path is open. `/admin` and everything under it need the admin token, `/metrics`
    the metrics token or the admin token."""
    if path == METRICS_PATH:
        named = {"metrics token": metrics_token, "admin token": admin_token}
    elif path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
        named = {"admin token": admin_token}
    else:
        return {}
    return {name: token for name, token in named.items() if token}


def operator_auth(admin_token: str | None, metrics_token: str | None) -> Middleware:
    """The middleware that answers 401 (an ApiError, which `error_middleware` outside it renders and counts) to a
    request for an operator endpoint without one of its tokens. Both the path asked for and the route aiohttp
    matched are checked, so no spelling of a path that reaches an operator handler (percent-escapes, say) gets
    past."""
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        for path in {request.path, resource.canonical if resource is not None else request.path}:
            tokens = tokens_for(path, admin_token, metrics_token)
            if tokens:
                require_bearer(request.headers.get("Authorization"), tokens.values(), name=" or ".join(tokens))
        return await handler(request)
    return middleware
