"""Usage accounting: per tenant and model, requests by outcome and tokens by kind, in /metrics and /admin/stats,
and one JSON line per finished request in the usage log, which a gateway restart only adds to.

The official openai SDK and raw HTTP -> kvgate router -> sim replicas that report usage and cached tokens.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import openai
import pytest

from kvgate.router.app import GatewaySettings
from kvgate.router.main import main as router_main
from kvgate.router.usage_log import UsageLog
from tests.router.sim_gateway import chat, gateway, write_registry
from tests.router.test_tenants import ACME_KEY, GLOBEX_KEY, SECRET, write_tenants


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def sdk(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10.0)


async def serve_acme_and_globex(url: str) -> list[tuple[str, str, str, object]]:
    """A non-streamed and a streamed (with usage) request by acme on m, one by globex on its adapter sql;
    (request id, tenant, model, usage) of each."""
    acme, globex = sdk(url, ACME_KEY), sdk(url, GLOBEX_KEY)
    served = []
    try:
        raw = await acme.chat.completions.with_raw_response.create(**chat("hello there"))
        served.append((raw.headers["x-request-id"], "acme", "m", raw.parse().usage))
        raw = await acme.chat.completions.with_raw_response.create(
            **chat("a streamed hello"), stream=True, stream_options={"include_usage": True})
        usage = [chunk.usage async for chunk in raw.parse() if chunk.usage is not None][-1]
        served.append((raw.headers["x-request-id"], "acme", "m", usage))
        raw = await globex.chat.completions.with_raw_response.create(**chat("select 1", model="sql"))
        served.append((raw.headers["x-request-id"], "globex", "sql", raw.parse().usage))
    finally:
        await acme.close()
        await globex.close()
    return served


async def test_the_usage_log_keeps_every_request_across_a_gateway_restart(tmp_path: Path) -> None:
    registry, usage_log = tmp_path / "registry", tmp_path / "billing" / "usage.jsonl"
    registry.mkdir()
    write_tenants(registry)
    settings = GatewaySettings(key_secret=SECRET, usage_log_path=str(usage_log))
    async with gateway(registry, num_replicas=1, settings=settings) as gw:
        served = await serve_acme_and_globex(gw.url)
    async with gateway(registry, num_replicas=1, settings=settings) as gw:  # a new gateway on the same file
        served += await serve_acme_and_globex(gw.url)
    records = {r["request_id"]: r for r in lines_of(usage_log)}
    assert len(records) == len(served) == 6
    for request_id, tenant, model, usage in served:
        record = records[request_id]
        assert (record["tenant"], record["model"], record["outcome"], record["status"]) == (tenant, model, "success",
                                                                                          200)
        assert record["usage_reported"] is True
        assert (record["prompt_tokens"], record["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
        assert record["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    text = usage_log.read_text()
    assert ACME_KEY not in text and GLOBEX_KEY not in text and "hello there" not in text  # no key, no prompt


async def test_tenant_series_count_requests_by_outcome_and_tokens_by_kind(tmp_path: Path) -> None:
    write_tenants(tmp_path)
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(key_secret=SECRET)) as gw:
        served = await serve_acme_and_globex(gw.url)
        await gw.fail(gw.sims[0], mode="error500")  # every attempt 500: passed through once retries are spent
        failed = await gw.post("/v1/chat/completions", json.dumps(chat("hi")).encode(),
                               {"Authorization": f"Bearer {ACME_KEY}"})
        metrics = await get_text(gw.url + "/metrics")
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/stats") as r:
            stats = await r.json()
    assert failed[0] == 500
    acme = [u for _, tenant, _, u in served if tenant == "acme"]
    prompt, completion = sum(u.prompt_tokens for u in acme), sum(u.completion_tokens for u in acme)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in acme)
    assert 'kvgate_router_tenant_requests_total{model="m",outcome="success",tenant="acme"} 2.0' in metrics
    assert 'kvgate_router_tenant_requests_total{model="m",outcome="upstream_5xx",tenant="acme"} 1.0' in metrics
    assert 'kvgate_router_tenant_requests_total{model="sql",outcome="success",tenant="globex"} 1.0' in metrics
    assert f'kvgate_router_tenant_tokens_total{{kind="prompt",model="m",tenant="acme"}} {float(prompt)}' in metrics
    assert f'kvgate_router_tenant_tokens_total{{kind="completion",model="m",tenant="acme"}} {float(completion)}' \
        in metrics
    assert f'kvgate_router_tenant_tokens_total{{kind="cached",model="m",tenant="acme"}} {float(cached)}' in metrics
    assert ACME_KEY not in metrics and GLOBEX_KEY not in metrics
    assert stats["usage"]["acme"]["m"] == {"requests": 3, "errors": 1, "prompt_tokens": prompt,
                                           "cached_tokens": cached, "completion_tokens": completion}
    assert stats["usage"]["globex"]["sql"]["requests"] == 1


async def test_an_open_gateway_counts_under_open_and_a_request_with_no_replica_as_a_gateway_error(
        tmp_path: Path) -> None:
    usage_log = tmp_path / "usage.jsonl"
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(usage_log_path=str(usage_log))) as gw:
        ok = await gw.client.chat.completions.create(**chat("hi"), stream=True)  # no include_usage: no tokens
        assert [chunk async for chunk in ok]
        cold = await gw.post("/v1/chat/completions", json.dumps(chat("hi", model="cold")).encode())
        metrics = await get_text(gw.url + "/metrics")
    assert cold[0] == 503  # model cold has no replica: the gateway's own 503 after its queue wait
    assert 'kvgate_router_tenant_requests_total{model="m",outcome="success",tenant="_open"} 1.0' in metrics
    assert 'kvgate_router_tenant_requests_total{model="cold",outcome="gateway_error",tenant="_open"} 1.0' in metrics
    assert 'kvgate_router_tenant_tokens_total{kind="prompt",model="m",tenant="_open"}' not in metrics
    records = lines_of(usage_log)
    assert [(r["tenant"], r["model"], r["outcome"], r["status"], r["usage_reported"]) for r in records] == [
        ("_open", "m", "success", 200, False), ("_open", "cold", "gateway_error", 503, False)]


def test_a_renamed_usage_log_is_followed_by_a_new_file_at_its_path(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path, now=lambda: 0.0)
    try:
        log.append({"n": 1})
        until(lambda: path.exists() and path.read_text() == '{"n":1}\n')
        os.rename(path, tmp_path / "usage.jsonl.1")  # what logrotate does (without copytruncate)
        log.append({"n": 2})
    finally:
        log.close()
    assert lines_of(tmp_path / "usage.jsonl.1") == [{"n": 1}]
    assert lines_of(path) == [{"n": 2}]


def test_a_stalled_writer_drops_records_past_its_queue_and_counts_them(tmp_path: Path) -> None:
    dropped: list[int] = []
    log = UsageLog(tmp_path / "usage.jsonl", now=lambda: 0.0, on_dropped=lambda: dropped.append(1), max_queued=2)
    disk_back = threading.Event()
    original = log._write  # noqa: SLF001 - hold the writer thread in its write, as a stalled disk would
    log._write = lambda lines, n: (disk_back.wait(), original(lines, n))  # type: ignore[method-assign]
    try:
        for n in range(10):
            log.append({"n": n})
    finally:
        disk_back.set()
        log.close()
    assert log.num_dropped == len(dropped) > 0
    assert log.num_written + log.num_dropped == 10


def test_the_router_refuses_to_start_when_its_usage_log_cannot_be_opened(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_registry(tmp_path, [])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = router_main(["--registry", str(tmp_path), "--port", "0", "--usage-log", str(blocker / "usage.jsonl")])
    assert code == 2 and "usage.jsonl" in capsys.readouterr().err


def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait on this thread for the writer thread to make `predicate` true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
