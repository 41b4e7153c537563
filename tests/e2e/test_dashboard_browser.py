"""The dashboard in real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright; no
`playwright install`), against a real gateway in front of a real `kvgate engine` on tiny-llama (gRPC
state stream: KV usage, adapters) and a simulated replica.

The autoscaler's status record is written by the test in the documented schema, standing in for the
autoscaler's loop, which is not part of the gateway. Full-page screenshots at 1,280 and 1,920 px are saved
under .test-artifacts/ (paths printed); docs/dashboard-1280.png and docs/dashboard-1920.png are copies of them.
"""

from __future__ import annotations

import asyncio
import re
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
SEARCHED_ID = "ops-browser-req-7"  # the X-Request-Id of one request, looked up in the page's search
WIDTHS = (1280, 1920)

# Every element of the page wider than its own box (content cut off or scrolled sideways), and the page itself
# wider than the window. Inline elements (clientWidth 0) and SVG are skipped: their boxes are their content.
OVERFLOWS_JS = """() => {
  const bad = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth) bad.push(`page: ${doc.scrollWidth} > ${doc.clientWidth} px`);
  for (const el of document.querySelectorAll("header, header *, main, main *")) {
    if (!(el instanceof HTMLElement) || el.clientWidth === 0) continue;
    if (el.scrollWidth > el.clientWidth + 1) {
      const name = el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className ? "." + el.className : "");
      bad.push(`${name} "${el.textContent.slice(0, 40)}": ${el.scrollWidth} > ${el.clientWidth} px`);
    }
  }
  for (const table of document.querySelectorAll("main table")) {
    const section = table.closest("section").getBoundingClientRect(), box = table.getBoundingClientRect();
    if (box.right > section.right || box.left < section.left) bad.push(`a table outside its card: ${table.id}`);
  }
  return bad;
}"""


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
        statuses.append(await stack.chat(session, "the one to look up", request_id=SEARCHED_ID))
    assert statuses == [200] * len(statuses)
    return len(statuses)


async def refuse_one(stack: Stack) -> None:
    """A request naming no declared model: the gateway's own 404, a 4xx of the "(no model)" line."""
    async with aiohttp.ClientSession() as session:
        assert await stack.chat(session, "who?", model="no-such-model") == 404


def collect_errors(page: Page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    return errors


async def chart_extent(page: Page, chart: str) -> tuple[str, str, float]:
    """A chart's span attribute, its leftmost time label and how wide its first drawn line is (px)."""
    svg = page.locator(f"#{chart} svg")
    labels = await svg.locator("text.xtick").all_text_contents()
    width = await svg.locator("path.series").first.evaluate("p => p.getBBox().width")
    return await svg.get_attribute("data-span-s") or "", labels[-1], width


async def check_layout(page: Page, width: int) -> None:
    """Nothing overflows at `width`; the autoscaler's forecast and the scaling events' messages show whole."""
    await page.set_viewport_size({"width": width, "height": 1300})
    await page.wait_for_timeout(400)  # the charts redraw at the new width (100 ms after the resize)
    assert await page.evaluate(OVERFLOWS_JS) == [], f"at {width} px"
    forecast = page.locator(f'#autoscaler tr[data-model="{MODEL}"] td.forecast')
    assert await forecast.evaluate("td => td.getBoundingClientRect().right <= Math.min(window.innerWidth, "
                                   "td.closest('section').getBoundingClientRect().right)")
    for message in await page.locator("#events .event-message").all():
        assert await message.evaluate("m => m.scrollWidth <= m.clientWidth"), await message.inner_text()
    svg_width = await page.locator("#c-ttft svg").evaluate("s => s.getBoundingClientRect().width")
    box_width = await page.locator("#c-ttft").evaluate("d => d.clientWidth")
    assert abs(svg_width - box_width) <= 1  # drawn at its box's width: no stretched text


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

            page = await browser.new_page(viewport={"width": WIDTHS[0], "height": 1300})
            errors = collect_errors(page)
            await page.goto(f"{stack.url}/dashboard?token={TOKEN}")
            await expect(page.locator("#conn")).to_have_text("live")
            assert TOKEN not in page.url  # taken off the address bar (and so the history and Referer)
            await expect(page.locator("#no-autoscaler")).to_be_visible()
            await expect(page.locator("#total-requests")).to_have_text("0")
            await expect(page.locator('tr[data-replica="engine-0"]')).to_contain_text("node-b")

            started = time.monotonic()
            num_requests = await send_traffic(stack)
            await refuse_one(stack)
            print(f"\n{num_requests + 1} requests in {time.monotonic() - started:.2f} s")
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
            # Charts: a drawn line per declared model for request rate (the refused request's "(no model)" is only
            # in the error chart), and at least one routing reason.
            await expect(page.locator("#c-rate path.series")).to_have_count(2)
            assert await page.locator("#c-reasons path.series").count() >= 1
            # The autoscaler panel reads the status record: desired vs ready, panic, nodes by pool and price.
            await expect(page.locator("#autoscaler")).to_contain_text("queue 6 / target 2")
            await expect(page.locator(f'#autoscaler tr[data-model="{MODEL}"] td.forecast')).to_have_text("3.50")
            await expect(page.locator("#models")).to_contain_text("2 / 3")
            await expect(page.locator("#nodes")).to_contain_text("aws-us-east-1 · spot")
            await expect(page.locator("#cost")).to_have_text("$0.40/h now ($0.01 total)")

            # Every value says what it counts.
            await expect(page.locator("#replicas .prefix-index").first).to_have_text(
                re.compile(r"^\d+ of \d+ (chunks|KV blocks)$"))
            decision = page.locator("#decisions tr").first
            await expect(decision).to_contain_text(re.compile(r"\d+ (chunks?|KV blocks?)"))
            await expect(decision).to_contain_text(re.compile(r"\d+ requests?"))
            # The new charts: errors per model (the refusal is a 4xx of "(no model)"), tokens/s by kind.
            await expect(page.locator("#c-errors .legend")).to_contain_text("(no model) 4xx")
            assert await page.locator("#c-errors path.series").count() >= 2
            await expect(page.locator("#c-tokens path.series")).to_have_count(3)
            await expect(page.locator("#c-tokens .legend")).to_have_text("promptcachedcompletion")
            await expect(page.locator("#refusals")).to_contain_text("unknown model")
            # Per adapter: 2 streamed sql requests per wave, the rest on the base model.
            adapters = page.locator(f'#adapters tr[data-model="{MODEL}"]')
            await expect(adapters.and_(page.locator('[data-adapter="sql"]')).locator(".adapter-requests")).to_have_text("6")
            await expect(adapters.and_(page.locator('[data-adapter=""]')).locator(".adapter-requests")).to_have_text(
                str(num_requests - 6))
            # TTFT: lines, one unit for the whole axis.
            ttft = page.locator("#c-ttft")
            assert "L" in (await ttft.locator("path.series").first.get_attribute("d") or "")
            await expect(ttft.locator("text.unit")).to_have_text(re.compile(r"^(ms|s)$"))
            for tick in await ttft.locator("text.tick").all_text_contents():
                assert re.fullmatch(r"[\d.]+", tick), tick

            # The search finds the decision of the request sent with its own X-Request-Id.
            await page.fill("#decision-search", SEARCHED_ID)
            found = page.locator("#decisions tr")
            await expect(found).to_have_count(1)
            await expect(found.first).to_have_attribute("data-request-id", SEARCHED_ID)
            await expect(found.first).to_contain_text(MODEL)
            await expect(page.locator("#search-note")).to_contain_text("1 decision for")
            await page.fill("#decision-search", "ops-browser-req-")  # part of an id finds it too
            await expect(found).to_have_count(1)
            await page.fill("#decision-search", "no-such-request")
            await expect(found).to_have_count(0)
            await expect(page.locator("#search-note")).to_contain_text("no decision for")
            await page.fill("#decision-search", "")
            await expect(found).to_have_count(min(15, num_requests))

            # The time range: the same data over the last 5 minutes, then over the hour (a narrower line).
            span, leftmost, short_width = await chart_extent(page, "c-rate")
            assert (span, leftmost) == ("300", "-5 min")
            await page.click('#ranges button[data-range="3600"]')
            await expect(page.locator('#ranges button[data-range="3600"]')).to_have_class("on")
            await expect(page.locator("#c-rate svg")).to_have_attribute("data-span-s", "3600")
            span, leftmost, long_width = await chart_extent(page, "c-rate")
            assert (span, leftmost) == ("3600", "-1 h")
            assert long_width < short_width / 4, (short_width, long_width)
            await page.click('#ranges button[data-range="300"]')
            await expect(page.locator("#c-rate svg")).to_have_attribute("data-span-s", "300")

            await asyncio.sleep(1.6)  # let the charts take one more poll after the last wave
            ARTIFACTS.mkdir(exist_ok=True)
            for width in WIDTHS:
                await check_layout(page, width)
                shot = ARTIFACTS / f"dashboard-{width}.png"
                await page.screenshot(path=str(shot), full_page=True)
                print(f"dashboard screenshot at {width} px: {shot}")
                assert shot.stat().st_size > 10_000
            # A replica whose membership record goes (the autoscaler is down) keeps serving, flagged.
            await stack.store.remove_member("sim-0")
            await expect(page.locator('tr[data-replica="sim-0"] .unlisted')).to_contain_text("unlisted")
            await expect(page.locator('tr[data-replica="sim-0"]')).to_contain_text("healthy")
            assert errors == [], errors
        finally:
            await browser.close()
