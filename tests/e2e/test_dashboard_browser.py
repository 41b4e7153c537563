"""The dashboard in real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright; no
`playwright install`), against a real gateway in front of a real `kvgate engine` on tiny-llama (gRPC
state stream: KV usage, adapters) and a simulated replica.

The autoscaler's status record is written by the test in the documented schema, standing in for the
autoscaler's loop, which is not part of the gateway. A full-page screenshot is saved under
.test-artifacts/ (path printed); docs/dashboard.png is a copy of one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import Page, async_playwright, expect

from tests.e2e.dashboard_stack import ADAPTER, MODEL, Stack, dashboard_stack, write_autoscaler_status
from tests.engine.peft_files import write_peft_dir
from tests.engine_server.test_process import Replica, start_replica, stop
from tests.services import free_loopback_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[2] / ".test-artifacts"
TOKEN = "dash-token"


@pytest.fixture
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, str]]:
    work = tmp_path_factory.mktemp("engine")
    grpc_port = free_loopback_port()
    adapter = write_peft_dir(work / "sql")
    replica = start_replica(work, "--grpc-port", str(grpc_port), "--adapter", f"{ADAPTER}={adapter}")
    try:
        yield replica, f"127.0.0.1:{grpc_port}"
    finally:
        stop(replica)


async def send_traffic(stack: Stack) -> int:
    """Shared-prefix chat, adapter requests and distinct prompts, in waves, so every chart has a
    shape. Returns the number of requests sent (all must succeed)."""
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:
        statuses.append(await stack.chat(session, "warm the shared prefix"))
        for wave in range(3):
            statuses += await asyncio.gather(
                *(stack.chat(session, f"wave {wave} question {i}") for i in range(6)),
                *(stack.chat(session, f"wave {wave} sql {i}", model=ADAPTER, stream=True) for i in range(2)),
                *(stack.chat(session, f"a brand new topic {wave}-{i} " * 20) for i in range(2)))
            await asyncio.sleep(0.6)  # one history sample per wave at least
    assert statuses == [200] * len(statuses)
    return len(statuses)


def collect_errors(page: Page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    return errors


async def test_dashboard_shows_live_traffic_in_headless_chromium(tmp_path: Path, engine: tuple[Replica, str]) -> None:
    expect.set_options(timeout=10_000)
    replica, grpc_target = engine
    engines = [(replica.url, grpc_target)]
    async with dashboard_stack(tmp_path, num_replicas=1, admin_token=TOKEN, engines=engines) as stack, \
            async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # Without the token the page asks for it, then goes live with it.
            asking = await browser.new_page()
            await asking.goto(stack.url + "/dashboard")
            await expect(asking.locator("#auth")).to_be_visible()
            await asking.fill("#token", TOKEN)
            await asking.click("#auth button")
            await expect(asking.locator("#conn")).to_have_text("live")
            await asking.close()

            page = await browser.new_page(viewport={"width": 1500, "height": 1300})
            errors = collect_errors(page)
            await page.goto(f"{stack.url}/dashboard?token={TOKEN}")
            await expect(page.locator("#conn")).to_have_text("live")
            assert TOKEN not in page.url  # taken off the address bar (and so the history and Referer)
            await expect(page.locator("#no-autoscaler")).to_be_visible()
            await expect(page.locator("#total-requests")).to_have_text("0")
            await expect(page.locator('tr[data-replica="engine-0"]')).to_contain_text("node-b")

            started = time.monotonic()
            num_requests = await send_traffic(stack)
            print(f"\n{num_requests} requests in {time.monotonic() - started:.2f} s")
            wall = (await stack.get_json("/admin/stats"))["wall"]
            await write_autoscaler_status(stack.store, wall=wall, desired=3, ready=2)

            # The numbers follow the traffic.
            await expect(page.locator("#total-requests")).to_have_text(str(num_requests))
            row = page.locator(f'tr[data-model="{MODEL}"]')
            await expect(row.locator(".req-total")).to_have_text(str(num_requests))
            assert float(await row.locator(".req-rate").inner_text()) > 0
            await expect(page.locator("#decisions tr").first).to_be_visible()
            await expect(page.locator("#tenants")).to_contain_text("_open")  # one flow through the fair queue
            # The engine reports KV blocks over gRPC: its KV usage is a percentage, not a dash.
            await expect(page.locator('tr[data-replica="engine-0"]')).to_contain_text("%")
            # Both replicas cache prefixes: neither is flagged as keeping no prefix cache.
            await expect(page.locator("#replicas .prefix-caching")).to_have_count(0)
            # Charts: a drawn line per model for request rate, and at least one routing reason.
            await expect(page.locator("#c-rate path.series")).to_have_count(2)
            assert await page.locator("#c-reasons path.series").count() >= 1
            # The autoscaler panel reads the status record: desired vs ready, panic, nodes by pool and price.
            await expect(page.locator("#autoscaler")).to_contain_text("queue 6 / target 2")
            await expect(page.locator("#models")).to_contain_text("2 / 3")
            await expect(page.locator("#nodes")).to_contain_text("aws-us-east-1 · spot")
            await expect(page.locator("#cost")).to_contain_text("$0.40")

            await asyncio.sleep(1.6)  # let the charts take one more poll after the last wave
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot: {shot}")
            assert shot.stat().st_size > 10_000
            # A replica whose membership record goes (the autoscaler is down) keeps serving, flagged.
            await stack.store.remove_member("sim-0")
            await expect(page.locator('tr[data-replica="sim-0"] .unlisted')).to_contain_text("unlisted")
            await expect(page.locator('tr[data-replica="sim-0"]')).to_contain_text("healthy")
            assert errors == [], errors
        finally:
            await browser.close()
