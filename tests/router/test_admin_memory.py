"""`/admin/memory`: the gateway's RSS and, while tracemalloc traces, its largest allocation sites and their growth
since a baseline, behind the admin token; on a real gateway over simulated replicas, in a `kvgate router` process
started with PYTHONTRACEMALLOC, and the pure formatting (`router.memory`)."""

from __future__ import annotations

import contextlib
import gc
import json
import tracemalloc
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvgate.router.app import GatewaySettings
from kvgate.router import memory
from kvgate.router.memory import (DEFAULT_TOP, MAX_TOP, Baseline, LookFailed, Traced, decode_sites, encode_sites,
                                  growth, memory_report, run_forked, short_path, sites_report, top_param,
                                  vm_rss_bytes)
from kvgate.openai_wire import ApiError
from tests.registry_docs import static_model
from tests.router.sim_gateway import Gateway, gateway
from tests.services import free_loopback_port, http_answers, kvgate_command, running

ADMIN = "adm1n-s3cret-token"
THIS_FILE = Path(__file__).name
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@contextlib.contextmanager
def tracing_set(on: bool) -> Iterator[None]:
    """tracemalloc on (or off) inside the block, as it was after (PYTHONTRACEMALLOC may have started it). The
    in-process gateway shares this interpreter."""
    was_tracing = tracemalloc.is_tracing()
    (tracemalloc.start if on else tracemalloc.stop)()
    try:
        yield
    finally:
        if was_tracing != on:
            (tracemalloc.start if was_tracing else tracemalloc.stop)()


@pytest.fixture
def tracing() -> Iterator[None]:
    with tracing_set(True):
        yield


@pytest.fixture
def not_tracing() -> Iterator[None]:
    with tracing_set(False):
        yield


async def call(gw: Gateway, path: str, method: str = "GET", headers: dict[str, str] | None = AUTH) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, gw.url + path, headers=headers) as r:
        return r.status, await r.json()


def hoard() -> list[bytearray]:
    """~4 MB in 2,000 blocks, allocated at one line of this file: the leak the growth list must name."""
    return [bytearray(2_000) for _ in range(2_000)]


class Knot:
    """One object of a reference cycle: freed only by the cyclic garbage collector."""

    def __init__(self) -> None:
        self.me = self
        self.payload = bytearray(1_000)


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# ------------------------------------------------------------------------------------------- over HTTP


async def test_memory_needs_the_admin_token_and_never_echoes_it(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1, settings=GatewaySettings(admin_token=ADMIN)) as gw:
        for method, path in (("GET", "/admin/memory"), ("POST", "/admin/memory/baseline")):
            status, body = await call(gw, path, method, headers=None)
            assert status == 401 and body["error"]["code"] == "invalid_admin_token", path
        status, body = await call(gw, "/admin/memory")
        assert status == 200 and ADMIN not in json.dumps(body)


@pytest.mark.usefixtures("not_tracing")
async def test_without_tracing_it_reports_the_rss_and_tracing_false(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        status, body = await call(gw, "/admin/memory")
        assert status == 200 and body["tracing"] is False and "top" not in body and "garbage" not in body
        assert len(body["gc"]["collections"]) == 3 and len(body["gc"]["pending"]) == 3  # gc's, tracing or not
        assert body["rss_bytes"] > 10 * 2**20 and body["rss_mib"] == pytest.approx(body["rss_bytes"] / 2**20)
        status, baseline = await call(gw, "/admin/memory/baseline", "POST")
        assert status == 200 and baseline["tracing"] is False and baseline["num_sites"] == 0
        assert "growth" not in (await call(gw, "/admin/memory"))[1]


@pytest.mark.usefixtures("tracing")
async def test_while_tracing_it_lists_the_largest_sites_by_file_and_line(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        kept = hoard()
        status, body = await call(gw, "/admin/memory?top=5")
        assert status == 200 and body["tracing"] is True and len(body["top"]) == 5
        assert body["traced_current_bytes"] >= 4_000_000 and body["traced_peak_bytes"] >= body["traced_current_bytes"]
        assert body["tracemalloc_overhead_bytes"] > 0 and body["num_sites"] > 5
        sizes = [site["size_bytes"] for site in body["top"]]
        assert sizes == sorted(sizes, reverse=True)
        ours = [site for site in body["top"] if THIS_FILE in site["site"]]
        assert ours and ours[0]["size_bytes"] >= 4_000_000 and ours[0]["num_blocks"] >= 2_000
        assert len((await call(gw, "/admin/memory"))[1]["top"]) == DEFAULT_TOP
        status, figures = await call(gw, "/admin/memory?top=0")  # no snapshot: cheap enough to poll
        assert status == 200 and figures["traced_current_bytes"] >= 4_000_000 and "top" not in figures
        # The look was taken in a forked copy: the snapshot's ~100 bytes per live block never touched this process.
        tracemalloc.reset_peak()
        await call(gw, "/admin/memory?top=50")
        current, peak = tracemalloc.get_traced_memory()
        assert peak - current < 2**20
        assert len((await call(gw, f"/admin/memory?top={MAX_TOP * 10}"))[1]["top"]) <= MAX_TOP
        del kept


@pytest.mark.usefixtures("tracing")
async def test_after_a_baseline_the_growth_list_names_the_line_that_grew(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        assert "growth" not in (await call(gw, "/admin/memory"))[1]  # no baseline yet
        status, baseline = await call(gw, "/admin/memory/baseline", "POST")
        assert status == 200 and baseline["tracing"] is True and baseline["num_sites"] > 0
        kept = hoard()
        status, body = await call(gw, "/admin/memory?top=3")
        assert status == 200 and body["baseline_age_s"] >= 0 and len(body["growth"]) <= 3
        first = body["growth"][0]
        assert THIS_FILE in first["site"] and first["size_diff_bytes"] >= 4_000_000
        assert first["num_blocks_diff"] >= 2_000
        del kept


@pytest.mark.usefixtures("tracing")
async def test_a_look_that_fails_is_a_503_error_object_and_the_gateway_serves_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict:
        raise RuntimeError("in the forked copy")
    monkeypatch.setattr(memory, "_snapshot_sites", broken)  # the copy inherits it
    async with gateway(tmp_path, num_replicas=1) as gw:
        for method, path in (("GET", "/admin/memory"), ("POST", "/admin/memory/baseline")):
            status, body = await call(gw, path, method)
            assert status == 503 and body["error"]["code"] == "memory_look_failed", path
        status, body = await call(gw, "/admin/memory?top=0")  # the figures need no look
        assert status == 200 and body["tracing"] is True
        answer = await gw.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2)
        assert answer.choices[0].finish_reason


@pytest.mark.usefixtures("tracing", "no_automatic_collection")
async def test_garbage_waiting_for_a_collection_is_measured_by_type_and_left_out_of_the_sites(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        knots = [Knot() for _ in range(3_000)]  # ~3 MB in cycles
        del knots
        status, body = await call(gw, "/admin/memory?top=10")
        assert status == 200 and body["garbage"]["bytes"] >= 3_000_000
        assert body["garbage"]["num_objects"] >= 3_000
        assert {"type": f"{__name__}.Knot", "num_objects": 3_000} in body["garbage"]["types"]
        assert not [site for site in body["top"] if THIS_FILE in site["site"]]  # the sites: what stays reachable
        assert body["traced_current_bytes"] >= 3_000_000  # still held here: only the copy collected it
        collected = gc.collect()
        assert collected >= 3_000  # the gateway's own collection had not run: the copy's freed nothing here


async def test_a_bad_top_is_a_400_error_object(tmp_path: Path) -> None:
    async with gateway(tmp_path, num_replicas=1) as gw:
        for value in ("-1", "abc", "2.5", ""):
            status, body = await call(gw, f"/admin/memory?top={value}")
            assert status == 400 and body["error"]["param"] == "top" and body["error"]["type"] == "BadRequestError"


def test_a_router_started_with_pythontracemalloc_traces_from_its_start(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONTRACEMALLOC", "1")
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "models.yaml").write_text(static_model("http://127.0.0.1:9"))
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*kvgate_command(), "router", "--registry", str(tmp_path / "registry"), "--port", str(port)]
    with running(argv, name="kvgate router", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                 log_path=tmp_path / "router.log"):
        with urllib.request.urlopen(url + "/admin/memory?top=3", timeout=30) as answer:
            body = json.load(answer)
    assert body["tracing"] is True and len(body["top"]) == 3
    # Traced from the first import on: the gateway's own modules hold some of what it allocated.
    assert body["traced_current_bytes"] > 1_000_000


# ------------------------------------------------------------------------------------------- pure parts


def test_vm_rss_is_read_in_bytes_from_proc_status() -> None:
    assert vm_rss_bytes("Name:\tpython\nVmPeak:\t  90000 kB\nVmRSS:\t   80124 kB\nThreads: 3\n") == 80124 * 1024
    assert vm_rss_bytes("Name:\tpython\n") is None


def test_top_defaults_caps_and_refuses_what_is_not_a_count() -> None:
    assert top_param(None) == DEFAULT_TOP and top_param("7") == 7 and top_param(str(MAX_TOP + 1)) == MAX_TOP
    assert top_param("0") == 0
    for bad in ("x", "-3", " 5"):
        with pytest.raises(ApiError) as refused:
            top_param(bad)
        assert refused.value.status == 400 and refused.value.param == "top"


def test_paths_are_shortened_to_the_package_or_the_standard_library() -> None:
    assert short_path("/v/lib/python3.12/site-packages/aiohttp/web_protocol.py") == "aiohttp/web_protocol.py"
    assert short_path("/usr/lib/python3.12/asyncio/selector_events.py") == "asyncio/selector_events.py"
    assert short_path("/work/main/router/prefix_index.py") == "/work/main/router/prefix_index.py"


def test_growth_lists_only_sites_that_grew_largest_first() -> None:
    before = {"a.py:1": (100, 1), "b.py:2": (500, 5), "gone.py:3": (900, 9)}
    after = {"a.py:1": (1_100, 11), "b.py:2": (400, 4), "new.py:4": (300, 3)}
    assert growth(before, after, top=5) == [
        {"site": "a.py:1", "size_diff_bytes": 1_000, "size_bytes": 1_100, "num_blocks_diff": 10},
        {"site": "new.py:4", "size_diff_bytes": 300, "size_bytes": 300, "num_blocks_diff": 3}]
    assert [g["site"] for g in growth(before, after, top=1)] == ["a.py:1"]


def test_the_report_without_tracing_is_the_rss_alone() -> None:
    assert memory_report(3 * 2**20, None, 25, None, 0.0) == {"rss_bytes": 3 * 2**20, "rss_mib": 3.0,
                                                            "tracing": False}


def test_the_report_while_tracing_gives_the_top_sites_and_the_growth_since_the_baseline() -> None:
    sites = {"a.py:1": (10, 1), "b.py:2": (30, 3), "c.py:3": (20, 2)}
    baseline_sites = {"c.py:3": (5, 1)}
    looked = sites_report(sites, 2, decode_sites(encode_sites(baseline_sites)))
    traced = Traced(current_bytes=60, peak_bytes=90, overhead_bytes=7)
    report = memory_report(None, traced, looked, Baseline(at_s=100.0, num_sites=1), 160.0)
    assert report["rss_bytes"] is None and report["tracing"] is True and report["num_sites"] == 3
    assert (report["traced_current_bytes"], report["traced_peak_bytes"], report["tracemalloc_overhead_bytes"]) == (
        60, 90, 7)
    assert [s["site"] for s in report["top"]] == ["b.py:2", "c.py:3"]
    assert report["baseline_age_s"] == 60.0 and [g["site"] for g in report["growth"]] == ["b.py:2", "c.py:3"]
    assert "top" not in memory_report(None, traced, None, None, 0.0)  # top=0: the figures alone


@pytest.mark.usefixtures("tracing")
def test_a_forked_look_sends_back_its_answer_and_keeps_what_it_allocated() -> None:
    tracemalloc.reset_peak()
    answer = run_forked(lambda: b"%d" % len(bytearray(50 * 2**20)))  # 50 MiB, in the copy only
    assert answer == b"%d" % (50 * 2**20)
    current, peak = tracemalloc.get_traced_memory()
    assert peak - current < 2**20


def test_a_forked_look_that_fails_or_hangs_is_a_look_failed() -> None:
    def fail() -> bytes:
        raise RuntimeError("in the copy")
    with pytest.raises(LookFailed, match="status"):
        run_forked(fail)
    with pytest.raises(LookFailed, match="did not finish within 0.5 s"):
        run_forked(lambda: __import__("time").sleep(30) or b"", timeout_s=0.5)
