"""Fair sharing at a real gateway over a sim replica that runs 2 requests at once: a quiet tenant's request goes
before a noisy tenant's backlog, priorities come only from tenants allowed them, and the lowest is shed before
its first byte when the wait would break the model's TTFT SLO."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp

from kvgate.registry.tenant import key_hmac
from kvgate.router.app import GatewaySettings
from loadtests.sim_replica_model import SchedulerSpec
from tests.eventually import eventually
from tests.router.sim_gateway import Gateway, chat, gateway

SECRET = b"fair-sharing-test-secret-0123456789abcdef"
KEYS = {"noisy": "kvg_noisy-tenant-key", "quiet": "kvg_quiet-tenant-key"}
KEYED = GatewaySettings(key_secret=SECRET)
# Two at once, 20 tokens in ~0.4 s: a backlog of 12 takes ~2.4 s to drain.
SLOW_SIM = SchedulerSpec(prefill_tokens_per_s=1e6, decode_tokens_per_s=50.0, max_batch=2)
SATURATES_AT_2 = ", max_in_flight_per_replica: 2"


def write_tenants(root: Path, quiet: str = "") -> None:
    (root / "tenants.yaml").write_text("\n---\n".join(f"""apiVersion: kvgate/v1
kind: Tenant
metadata: {{name: {name}}}
spec: {{api_key_hmac: "{key_hmac(SECRET, key)}", models: ['*'] {quiet if name == "quiet" else ""}}}
""" for name, key in KEYS.items()))


async def post(url: str, tenant: str | None, body: dict, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], dict, float]:
    """(status, headers, body, seconds to the answer) of one chat request as `tenant` (None: no key)."""
    auth = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    start = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", data=json.dumps(body),
                                                    headers={**auth, **(headers or {})}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None), time.monotonic() - start


async def quiet_rank_behind_a_burst(tmp_path: Path, routing: str) -> int:
    """How many of the noisy tenant's 12 requests, sent just before the quiet one, were answered first."""
    write_tenants(tmp_path)
    async with gateway(tmp_path, num_replicas=1, settings=KEYED, sim_spec=SLOW_SIM, routing=routing) as gw:
        finished: list[str] = []

        async def one(tenant: str) -> None:
            status, _, _, _ = await post(gw.url, tenant, chat("hi", max_tokens=20))
            assert status == 200
            finished.append(tenant)

        noisy = [asyncio.ensure_future(one("noisy")) for _ in range(12)]
        await eventually(lambda: _waiting(gw), "the burst has arrived: 2 run, 10 wait (at the gateway or the sim)")
        await one("quiet")
        await asyncio.gather(*noisy)
    return finished.index("quiet")


async def _waiting(gw: Gateway) -> bool:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/stats") as r:
            at_gateway = (await r.json())["models"]["m"]["fair_queue"]["waiting"]
        async with s.get(gw.sims[0].url + "/stats") as r:
            at_sim = (await r.json())["num_waiting"]
    return at_gateway + at_sim == 10


async def test_a_quiet_tenant_goes_before_a_noisy_tenants_backlog(tmp_path: Path) -> None:
    assert await quiet_rank_behind_a_burst(tmp_path, SATURATES_AT_2) <= 4


async def test_without_fair_queueing_the_quiet_tenant_waits_behind_the_backlog(tmp_path: Path) -> None:
    # Today's behaviour, for contrast: the replica queues first come, first served.
    assert await quiet_rank_behind_a_burst(tmp_path, SATURATES_AT_2 + ", fair_queueing: false") >= 10


async def test_a_capacity_learned_from_the_replicas_reports_holds_the_backlog_at_the_gateway(tmp_path: Path) -> None:
    # No max_in_flight_per_replica: the gateway learns the sim runs 2 (its vLLM-style /metrics, scraped every
    # 0.1 s, show 2 running and more waiting), and keeps 2 in flight there.
    write_tenants(tmp_path)
    async with gateway(tmp_path, num_replicas=1, settings=KEYED, sim_spec=SLOW_SIM, backend="vllm",
                       poll_interval_s=0.1) as gw:
        burst = [asyncio.ensure_future(post(gw.url, "noisy", chat("hi", max_tokens=100))) for _ in range(6)]
        await eventually(lambda: gw.tracker.capacity("m") == 2, "the sim's batch of 2 learned", timeout_s=10.0)
        await asyncio.gather(*burst)
        burst = [asyncio.ensure_future(post(gw.url, "noisy", chat("hi", max_tokens=50))) for _ in range(8)]
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            metrics = await r.text()
        await asyncio.gather(*burst)
    assert 'kvgate_router_fair_queue_depth{model="m",tenant="noisy"} 6.0' in metrics, metrics


async def test_priority_comes_only_from_a_tenant_allowed_it(tmp_path: Path) -> None:
    write_tenants(tmp_path, quiet=", priority: 0, max_priority: 5")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        allowed = await post(gw.url, "quiet", chat("hi"), {"x-kvgate-priority": "5"})
        lower = await post(gw.url, "noisy", chat("hi"), {"x-kvgate-priority": "-3"})
        above = await post(gw.url, "noisy", chat("hi"), {"x-kvgate-priority": "1"})
        garbled = await post(gw.url, "noisy", chat("hi"), {"x-kvgate-priority": "high"})
    assert allowed[0] == 200 and lower[0] == 200
    assert above[0] == 400 and above[2]["error"]["code"] == "invalid_priority"
    assert "above the highest this key may ask for (0)" in above[2]["error"]["message"]
    assert garbled[0] == 400 and "must be a whole number" in garbled[2]["error"]["message"]


async def test_the_lowest_priority_is_shed_before_its_first_byte_when_the_wait_would_break_the_slo(
        tmp_path: Path) -> None:
    # Each request holds its place ~0.4 s and 2 run at once; the SLO allows 1.5 s. A batch-priority
    # backlog is shed (503 model_overloaded) while the urgent requests sent beside it are all served.
    write_tenants(tmp_path, quiet=", priority: 1")
    async with gateway(tmp_path, num_replicas=1, settings=KEYED, sim_spec=SLOW_SIM, routing=SATURATES_AT_2,
                       spec="slo: {ttft_ms: 1500}") as gw:
        await asyncio.gather(*(post(gw.url, "noisy", chat("warm", max_tokens=20)) for _ in range(2)))
        batch = [asyncio.ensure_future(post(gw.url, "noisy", chat("hi", max_tokens=20))) for _ in range(30)]
        await asyncio.sleep(0.05)
        urgent = await asyncio.gather(*(post(gw.url, "quiet", chat("now", max_tokens=20)) for _ in range(3)))
        batch_answers = await asyncio.gather(*batch)
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            metrics = await r.text()
    shed = [answer for answer in batch_answers if answer[0] == 503]
    assert [answer[0] for answer in urgent] == [200, 200, 200]
    assert len(shed) >= 15, [answer[0] for answer in batch_answers]
    assert all(a[2]["error"]["code"] == "model_overloaded" and int(a[1]["Retry-After"]) >= 1 for a in shed)
    counted = f'kvgate_router_refused_requests_total{{model="m",reason="shed",status="503",tenant="noisy"}} {len(shed)}.0'
    assert counted in metrics
