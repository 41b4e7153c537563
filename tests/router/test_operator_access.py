"""The gateway's operator endpoints behind tokens: `/admin/*` (the dashboard's data) needs the admin token, and
`/metrics` the metrics token or the admin token, on a real gateway over real simulated replicas; and the pure
start-up verdict (`plan_access`) that keeps open operator endpoints off the network. The processes themselves
(exit status, start-up log) are in test_operator_access_process.py."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from kvgate.router.app import GatewaySettings
from kvgate.router.operator_access import ADMIN_TOKEN_ENV, INSECURE_FLAG, METRICS_TOKEN_ENV, plan_access
from tests.router.sim_gateway import Gateway, gateway

ADMIN = "adm1n-s3cret-token"
METRICS = "scr4pe-s3cret-token"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def get(gw: Gateway, path: str, headers: dict[str, str] | None = None,
              method: str = "GET") -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as s, s.request(method, gw.url + path, headers=headers) as r:
        return r.status, dict(r.headers), await r.text()


async def test_metrics_needs_the_admin_token_when_one_is_set(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(admin_token=ADMIN)) as gw:
        for headers in (None, bearer("wrong"), {"Authorization": ADMIN}, bearer(ADMIN[:-1]), bearer(METRICS)):
            status, answer_headers, body = await get(gw, "/metrics", headers)
            assert status == 401 and answer_headers["WWW-Authenticate"] == "Bearer", headers
            assert '"code": "invalid_admin_token"' in body and "admin token" in body and ADMIN not in body
        status, _, body = await get(gw, "/metrics", bearer(ADMIN))
        assert status == 200 and "kvgate_router_requests_total" in body


async def test_a_metrics_token_opens_metrics_and_nothing_else(tmp_path: Path) -> None:
    """Prometheus holds the metrics token: a leaked scrape config reads no routing decisions or placement."""
    settings = GatewaySettings(admin_token=ADMIN, metrics_token=METRICS)
    async with gateway(tmp_path, num_replicas=1, settings=settings) as gw:
        assert (await get(gw, "/metrics", bearer(METRICS)))[0] == 200
        assert (await get(gw, "/metrics", bearer(ADMIN)))[0] == 200  # the admin token opens everything
        status, _, body = await get(gw, "/metrics")
        assert status == 401 and "metrics token or admin token" in body
        for path in ("/admin/stats", "/admin/history"):
            assert (await get(gw, path, bearer(METRICS)))[0] == 401, path
            assert (await get(gw, path, bearer(ADMIN)))[0] == 200, path


async def test_a_metrics_token_alone_guards_metrics_and_leaves_admin_as_it_was(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(metrics_token=METRICS)) as gw:
        assert (await get(gw, "/metrics"))[0] == 401
        assert (await get(gw, "/metrics", bearer(METRICS)))[0] == 200
        assert (await get(gw, "/admin/stats"))[0] == 200  # no admin token: open (on loopback only, see below)


async def test_no_path_or_method_reaches_an_operator_endpoint_without_the_token(tmp_path: Path) -> None:
    """Every path under /admin/ is guarded, known or not (a 401, not a 404 that would map the endpoints), and a
    spelling that aiohttp routes to an operator handler is guarded as that handler."""
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(admin_token=ADMIN)) as gw:
        for path in ("/admin", "/admin/", "/admin/stats", "/admin/history", "/admin/nope", "/admin/stats?x=1",
                     "/%61dmin/stats", "/admin/%73tats", "/%6Detrics", "/metrics?format=json"):
            for method in ("GET", "HEAD"):
                status, _, _ = await get(gw, path, method=method)
                assert status == 401, (method, path)
        assert (await get(gw, "/admin/nope", bearer(ADMIN)))[0] == 404  # past the token: as before
        assert (await get(gw, "/health"))[0] == 200 and (await get(gw, "/dashboard"))[0] == 200  # hold no data
        assert (await get(gw, "/v1/models"))[0] == 200


async def test_refused_operator_requests_are_counted_as_unauthorized(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(admin_token=ADMIN)) as gw:
        for path in ("/metrics", "/admin/stats", "/admin/history"):
            await get(gw, path, bearer("wrong"))
        _, _, exported = await get(gw, "/metrics", bearer(ADMIN))
    assert 'kvgate_router_refused_requests_total{model="_unknown",reason="unauthorized",status="401",tenant="_none"} 3.0' in exported


async def test_without_tokens_the_operator_endpoints_stay_open_as_on_the_single_box(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        for path in ("/metrics", "/admin/stats", "/admin/history"):
            assert (await get(gw, path))[0] == 200, path


# ------------------------------------------------------------------------------------ the start-up verdict


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "gateway.internal", "[2001:db8::1]"])
def test_beyond_loopback_without_an_admin_token_the_gateway_refuses_to_start_saying_how(host: str) -> None:
    for environ in ({}, {ADMIN_TOKEN_ENV: ""}, {ADMIN_TOKEN_ENV: " \n"}, {METRICS_TOKEN_ENV: METRICS}):
        plan = plan_access(host, flag_token=None, environ=environ, insecure_open=False)
        assert plan.refusal and ADMIN_TOKEN_ENV in plan.refusal and INSECURE_FLAG in plan.refusal, environ
        assert "127.0.0.1" in plan.refusal


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_on_loopback_the_operator_endpoints_may_stay_open(host: str) -> None:
    plan = plan_access(host, flag_token=None, environ={}, insecure_open=False)
    assert (plan.refusal, plan.admin_token, plan.metrics_token) == (None, None, None)
    [(level, message)] = plan.notices
    assert level == logging.INFO and "no token (OPEN)" in message


def test_insecure_open_admin_starts_beyond_loopback_with_a_warning() -> None:
    plan = plan_access("0.0.0.0", flag_token=None, environ={}, insecure_open=True)
    assert plan.refusal is None and plan.admin_token is None
    [(level, message)] = plan.notices
    assert level == logging.WARNING and "INSECURE" in message and "0.0.0.0" in message and ADMIN_TOKEN_ENV in message


def test_tokens_come_from_the_environment_trimmed_and_never_appear_in_a_notice_or_repr() -> None:
    plan = plan_access("0.0.0.0", flag_token=None, insecure_open=True,
                       environ={ADMIN_TOKEN_ENV: f"{ADMIN}\n", METRICS_TOKEN_ENV: f" {METRICS} "})
    assert (plan.refusal, plan.admin_token, plan.metrics_token) == (None, ADMIN, METRICS)
    [(level, message)] = plan.notices
    assert level == logging.INFO and f"{INSECURE_FLAG} is ignored" in message
    assert f"/metrics needs ${METRICS_TOKEN_ENV} or the admin token" in message
    assert ADMIN not in repr(plan) + message and METRICS not in repr(plan) + message
    assert ADMIN not in repr(GatewaySettings(admin_token=ADMIN, metrics_token=METRICS))
    assert METRICS not in repr(GatewaySettings(admin_token=ADMIN, metrics_token=METRICS))


def test_the_admin_token_flag_still_works_and_says_it_is_deprecated() -> None:
    plan = plan_access("0.0.0.0", flag_token=ADMIN, environ={ADMIN_TOKEN_ENV: "from-env"}, insecure_open=False)
    assert (plan.refusal, plan.admin_token) == (None, ADMIN)  # an explicit flag wins, as it always has
    levels = [level for level, _ in plan.notices]
    assert levels == [logging.WARNING, logging.INFO]
    assert "--admin-token is deprecated" in plan.notices[0][1] and ADMIN_TOKEN_ENV in plan.notices[0][1]
    assert all(ADMIN not in message for _, message in plan.notices)
