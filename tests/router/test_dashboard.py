"""The dashboard's data: quantiles from histogram buckets, windowed rates (requests, errors, tokens, per
adapter), the bounded history and its two time ranges on a fake clock, and what /admin/stats and /admin/history
serve from a real gateway (in-process, real sockets, simulated replicas published in a real MemoryStateStore; see
tests/e2e/dashboard_stack.py), the request ids the page's search looks through included."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
from pathlib import Path

import aiohttp
import pytest

from kvgate.clock import FakeClock
from kvgate.state import AutoscalerStatus, MemoryStateStore
from kvgate.state.records import STATUS_COLLECTION, STATUS_ID, ModelStatus
from kvgate.router.dashboard import Dashboard, adapter_breakdown, collect_totals, dashboard_page
from kvgate.router.metrics import RouterMetrics
from kvgate.router.policies import Reason
from kvgate.router.queueing import WaitQueues
from kvgate.router.stats_history import ModelTotals, Sample, StatsHistory, histogram_quantile, window_stats
from tests.e2e.dashboard_stack import ADAPTER, MODEL, dashboard_stack, write_autoscaler_status
from tests.eventually import eventually

# ------------------------------------------------------------------------------------ quantiles


def test_quantile_interpolates_within_the_bucket_it_falls_in() -> None:
    # bounds (0.1, 0.5), 2 under 0.1, 6 in (0.1, 0.5], 2 above: p50 is rank 5 -> 0.1 + 0.4 * 3/6 = 0.3
    assert histogram_quantile(0.5, (0.1, 0.5), (2, 8, 10)) == pytest.approx(0.3)
    # p10 is rank 1 of the 2 in (0, 0.1] -> 0.05
    assert histogram_quantile(0.1, (0.1, 0.5), (2, 8, 10)) == pytest.approx(0.05)


def test_a_quantile_past_the_last_bound_reports_the_last_bound() -> None:
    assert histogram_quantile(0.99, (0.1, 0.5), (0, 0, 10)) == 0.5


def test_an_empty_histogram_has_no_quantile_and_bad_arguments_raise() -> None:
    assert histogram_quantile(0.5, (0.1, 0.5), (0, 0, 0)) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.0, (0.1,), (1, 1))
    with pytest.raises(ValueError, match="one more"):
        histogram_quantile(0.5, (0.1, 0.5), (1, 1))


# ---------------------------------------------------------------------------------- window stats


def test_window_rates_come_from_the_difference_of_two_totals() -> None:
    older = ModelTotals(requests=10, prompt_tokens=1000, predicted_tokens=400, realised_tokens=300,
                        reported_prompt_tokens=1000, ttft_bounds=(0.1, 1.0), ttft_counts=(5, 10, 10),
                        decisions={"prefix_hit": 4})
    newer = ModelTotals(requests=30, prompt_tokens=3000, predicted_tokens=1600, realised_tokens=1300,
                        reported_prompt_tokens=3000,
                        ttft_bounds=(0.1, 1.0), ttft_counts=(5, 30, 30),
                        decisions={"prefix_hit": 14, "load_fallback": 10, "rendezvous": 0})
    stats = window_stats(older, newer, seconds=4.0)
    assert stats.request_rate == 5.0  # 20 requests in 4 s
    assert stats.predicted_hit_rate == pytest.approx(0.6)  # 1200 of 2000 prompt tokens
    assert stats.realised_hit_rate == pytest.approx(0.5)  # 1000 of 2000
    assert stats.decision_rates == {"prefix_hit": 2.5, "load_fallback": 2.5}
    # all 20 new first bytes fell in (0.1, 1.0]: p50 is rank 10 of 20 there -> 0.1 + 0.9 * 0.5
    assert stats.ttft_p50_s == pytest.approx(0.55)


def test_window_with_no_traffic_has_no_quantiles_or_hit_rates_and_resets_count_as_zero() -> None:
    older = ModelTotals(requests=50, prompt_tokens=100, ttft_bounds=(0.1,), ttft_counts=(3, 3))
    newer = ModelTotals(requests=20, prompt_tokens=100, ttft_bounds=(0.1,), ttft_counts=(3, 3))
    stats = window_stats(older, newer, seconds=2.0)
    assert stats.request_rate == 0.0
    assert stats.ttft_p50_s is None and stats.predicted_hit_rate is None and stats.realised_hit_rate is None


def test_realised_hit_rate_is_capped_at_one_when_replicas_count_more_tokens_than_the_estimate() -> None:
    stats = window_stats(ModelTotals(), ModelTotals(prompt_tokens=100, realised_tokens=130, reported_prompt_tokens=100),
                         seconds=1.0)
    assert stats.realised_hit_rate == 1.0


def test_the_realised_hit_rate_counts_only_prompts_whose_responses_reported_cached_tokens() -> None:
    """vLLM leaves out usage.prompt_tokens_details unless run with --enable-prompt-tokens-details: those
    prompts are not 0% hits, they are unknown."""
    silent = window_stats(ModelTotals(), ModelTotals(prompt_tokens=1000, predicted_tokens=600), seconds=1.0)
    assert silent.predicted_hit_rate == pytest.approx(0.6) and silent.realised_hit_rate is None
    half = window_stats(ModelTotals(), ModelTotals(prompt_tokens=1000, predicted_tokens=600, realised_tokens=250,
                                                   reported_prompt_tokens=500), seconds=1.0)
    assert half.realised_hit_rate == pytest.approx(0.5)  # 250 of the 500 that were reported on


def test_the_error_rates_are_shares_of_the_windows_answers_and_refusals_are_rates_by_reason() -> None:
    older = ModelTotals(answers={"2xx": 10, "4xx": 1}, refused={"unknown_model": 1})
    newer = ModelTotals(answers={"2xx": 46, "4xx": 3, "5xx": 1, "stream_error": 1, "client_gone": 0},
                        refused={"unknown_model": 3, "no_capacity": 1})
    stats = window_stats(older, newer, seconds=4.0)
    # 40 answers in 4 s: 36 x 2xx, 2 x 4xx, one 5xx and one broken stream
    assert stats.answer_rate == 10.0
    assert stats.error_rate == pytest.approx(2 / 40)  # 5xx + stream_error
    assert stats.client_error_rate == pytest.approx(2 / 40)  # 4xx, apart
    assert stats.refusal_rates == {"unknown_model": 0.5, "no_capacity": 0.25}


def test_a_window_without_answers_has_no_error_rate_rather_than_zero() -> None:
    stats = window_stats(ModelTotals(answers={"2xx": 5}), ModelTotals(answers={"2xx": 5}), seconds=2.0)
    assert stats.answer_rate == 0.0 and stats.error_rate is None and stats.client_error_rate is None


def test_token_rates_sum_the_adapters_per_kind_and_keep_each_adapters_own() -> None:
    older = ModelTotals(tokens={"": {"prompt": 1000, "cached": 400, "completion": 100}},
                        adapter_requests={"": 10})
    newer = ModelTotals(tokens={"": {"prompt": 3000, "cached": 1600, "completion": 300},
                                "sql": {"prompt": 800, "cached": 0, "completion": 200}},
                        adapter_requests={"": 30, "sql": 8})
    stats = window_stats(older, newer, seconds=4.0)
    # base: +2000 prompt, +1200 cached, +200 completion; sql (new): +800, +0, +200; over 4 s
    assert stats.token_rates == {"prompt": 700.0, "cached": 300.0, "completion": 100.0}
    assert stats.adapter_token_rates == {"": {"prompt": 500.0, "cached": 300.0, "completion": 50.0},
                                         "sql": {"prompt": 200.0, "cached": 0.0, "completion": 50.0}}
    assert stats.adapter_request_rates == {"": 5.0, "sql": 2.0}
    assert stats.to_json()["token_rates"] == {"prompt": 700.0, "cached": 300.0, "completion": 100.0}


def test_the_adapter_breakdown_lists_the_base_model_first_with_totals_and_window_rates() -> None:
    totals = ModelTotals(adapter_requests={"sql": 8, "": 30}, tokens={"sql": {"prompt": 800, "completion": 200}})
    stats = window_stats(ModelTotals(adapter_requests={"": 10}), totals, seconds=4.0)
    rows = adapter_breakdown(totals, stats)
    assert [row["adapter"] for row in rows] == ["", "sql"]
    assert rows[0] == {"adapter": "", "requests_total": 30, "request_rate": 5.0,  # 20 in 4 s
                       "tokens_total": {"prompt": 0.0, "cached": 0.0, "completion": 0.0},
                       "token_rates": {"prompt": 0.0, "cached": 0.0, "completion": 0.0}}
    assert rows[1]["requests_total"] == 8 and rows[1]["request_rate"] == 2.0
    assert rows[1]["tokens_total"] == {"prompt": 800, "cached": 0.0, "completion": 200}
    assert rows[1]["token_rates"] == {"prompt": 200.0, "cached": 0.0, "completion": 50.0}
    # before the history has two samples there is no window: totals only
    assert adapter_breakdown(totals, None)[1]["request_rate"] is None


# ------------------------------------------------------------------------------------ the history


def _dashboard(clock: FakeClock, metrics: RouterMetrics, store: MemoryStateStore | None = None,
               ready: dict[str, int] | None = None) -> Dashboard:
    async def never(model: str, timeout_s: float) -> bool:
        return False
    return Dashboard(metrics=metrics, queues=WaitQueues(never), clock=clock,
                     ready_count=lambda m: (ready or {}).get(m, 0), model_names=lambda: ["a", "b"], store=store,
                     sample_interval_s=2.0, history_s=10.0)


async def test_a_status_record_of_a_newer_release_reads_as_no_autoscaler_and_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    dash = _dashboard(clock, RouterMetrics(), store=store)
    status = AutoscalerStatus(updated_at=clock.wall(), models={"a": ModelStatus(desired=3, ready=2, starting=1)})
    await store.put_record(STATUS_COLLECTION, STATUS_ID, {**status.to_json(), "added_later": [1, 2]})
    assert await dash.autoscaler_status() == status  # a newer minor: its extra field is ignored
    await store.put_record(STATUS_COLLECTION, STATUS_ID, {**status.to_json(), "schema_version": 2})
    with caplog.at_level(logging.WARNING, logger="kvgate.router.dashboard"):
        assert (await dash.extend_stats({"models": {}}))["autoscaler"] is None
        assert await dash.autoscaler_status() is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["skipping state store record autoscaler/status"]


async def test_a_broken_status_record_read_at_every_sample_is_logged_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    """The sampler reads the status record every 2 s: 60 reads over two minutes of a broken one are 2 lines."""
    clock = FakeClock()
    store = MemoryStateStore(clock)
    dash = _dashboard(clock, RouterMetrics(), store=store)
    await store.put_record(STATUS_COLLECTION, STATUS_ID, {"schema_version": 1, "models": "not a mapping"})
    with caplog.at_level(logging.WARNING, logger="kvgate.router.dashboard"):
        for _ in range(60):
            assert await dash.autoscaler_status() is None  # the page says "no autoscaler"
            await clock.advance(2.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("the autoscaler status record does not parse") for line in lines)
    assert lines[1].endswith(" (29 more in the last 60 s)"), lines


def _traffic(metrics: RouterMetrics, dash: Dashboard, n: int, ttft_s: float) -> None:
    for _ in range(n):
        metrics.requests.labels("a", "r1", "success").inc()
        metrics.decisions.labels("a", "prefix_hit").inc()
        metrics.ttft_seconds.labels("a", "true").observe(ttft_s)
        dash.note_request("a", 100)
    metrics.prefix_predicted_tokens.labels("a").inc(40 * n)
    metrics.prefix_realised_tokens.labels("a").inc(30 * n)
    metrics.prefix_reported_prompt_tokens.labels("a").inc(100 * n)


async def test_samples_on_a_fake_clock_give_one_point_per_interval_with_rates() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    dash = _dashboard(clock, metrics, ready={"a": 2})
    status = AutoscalerStatus(updated_at=clock.wall(), models={"a": ModelStatus(desired=3, ready=2, starting=1)})
    dash.take_sample(None)
    _traffic(metrics, dash, 10, ttft_s=0.2)  # 10 requests in the first 2 s
    await clock.advance(2.0)
    dash.take_sample(status)
    _traffic(metrics, dash, 2, ttft_s=0.02)  # then 2 in the next 2 s
    await clock.advance(2.0)
    dash.take_sample(status)
    series = dash.history.series()["ranges"][0]  # one range: a 10-s history is shorter than 5 minutes
    assert series["t"] == [clock.wall() - 2.0, clock.wall()]
    a = series["models"]["a"]
    assert a["request_rate"] == [5.0, 1.0]
    assert a["predicted_hit_rate"] == [0.4, 0.4] and a["realised_hit_rate"] == [0.3, 0.3]
    assert a["decision_rates"] == {"prefix_hit": [5.0, 1.0]}
    assert 0.1 < a["ttft_p50_s"][0] <= 0.25 and a["ttft_p50_s"][1] <= 0.025  # buckets (0.1, 0.25], (0.01, 0.025]
    assert a["ready"] == [2, 2] and a["desired"] == [3, 3]
    # a model with no traffic is still listed, with zero rates and no quantiles
    assert series["models"]["b"]["request_rate"] == [0.0, 0.0]
    assert series["models"]["b"]["ttft_p99_s"] == [None, None]


async def test_the_history_keeps_only_its_horizon() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    dash = _dashboard(clock, metrics)  # 10 s at one per 2 s: 6 samples, 5 points
    for _ in range(40):
        dash.take_sample(None)
        await clock.advance(2.0)
    assert len(dash.history) == 6
    assert len(dash.history.series()["ranges"][0]["t"]) == 5


async def test_latest_window_reaches_back_at_least_the_window() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    history = StatsHistory(interval_s=1.0, horizon_s=60.0)
    dash = _dashboard(clock, metrics)
    dash.history = history
    for second in range(12):
        if second >= 6:
            _traffic(metrics, dash, 3, ttft_s=0.05)  # 3 per second from t=6 on
        dash.take_sample(None)
        await clock.advance(1.0)
    latest = history.latest(window_s=4.0)
    assert latest["a"].seconds == 4.0
    assert latest["a"].request_rate == 3.0


async def test_a_sample_at_the_same_instant_replaces_the_last_and_its_point() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    dash = _dashboard(clock, metrics)
    dash.take_sample(None)
    dash.take_sample(None)
    assert len(dash.history) == 1
    await clock.advance(2.0)
    dash.take_sample(None)
    assert dash.history.series()["ranges"][0]["models"]["a"]["request_rate"] == [0.0]
    _traffic(metrics, dash, 4, ttft_s=0.05)
    dash.take_sample(None)  # same instant: the cached series is rebuilt with the new counts
    assert dash.history.series()["ranges"][0]["models"]["a"]["request_rate"] == [2.0]


def _sample(now: float, requests: float, models: tuple[str, ...] = ("a",)) -> Sample:
    return Sample(now=now, wall=1000.0 + now, models={m: ModelTotals(requests=requests) for m in models})


def test_an_hour_of_history_keeps_five_minutes_of_every_sample_and_the_hour_at_one_per_10_s() -> None:
    history = StatsHistory(interval_s=2.0, horizon_s=3600.0)
    assert history.ranges_s == (300.0, 3600.0)
    for tick in range(3600):  # two hours at 2 s, 3 requests a second
        history.add(_sample(2.0 * tick, requests=6.0 * tick))
    short, long = history.series()["ranges"]
    assert (short["span_s"], short["step_s"], long["span_s"], long["step_s"]) == (300.0, 2.0, 3600.0, 10.0)
    # 151 samples -> 150 points 2 s apart; 361 samples (0 .. 7190 s, one per 10 s) -> 360 points, plus the
    # trailing one from 7190 s to the newest sample at 7198 s
    assert len(short["t"]) == 150 and short["t"][-1] - short["t"][0] == 298.0
    assert len(long["t"]) == 361 and long["t"][-2] - long["t"][0] == 3590.0 and long["t"][-1] == 1000.0 + 7198.0
    assert history.num_samples_kept == 151 + 361 - 30  # the 30 10-s samples of the last 5 min are in both rings
    # a steady 3 req/s reads the same at every resolution, the trailing 8-s window included
    assert set(short["models"]["a"]["request_rate"]) == {3.0}
    assert set(long["models"]["a"]["request_rate"]) == {3.0}


def test_a_burst_reads_as_its_rate_over_each_ranges_window() -> None:
    history = StatsHistory(interval_s=2.0, horizon_s=3600.0)
    total = 0.0
    for tick in range(11):  # samples at 0 .. 20 s; 100 requests in the tick ending at 14 s
        total += 100.0 if tick == 7 else 0.0
        history.add(_sample(2.0 * tick, requests=total))
    short, long = history.series()["ranges"]
    assert short["models"]["a"]["request_rate"] == [0.0] * 6 + [50.0] + [0.0] * 3  # 100 in 2 s
    assert long["t"] == [1010.0, 1020.0]  # the windows 0 .. 10 s and 10 .. 20 s
    assert long["models"]["a"]["request_rate"] == [0.0, 10.0]  # 100 in the window 10 .. 20 s


def test_the_long_range_keeps_one_sample_per_fifth_tick_when_ticks_come_a_little_early_or_late() -> None:
    for tick_s in (1.999, 2.004):
        history = StatsHistory(interval_s=2.0, horizon_s=3600.0)
        for tick in range(21):
            history.add(_sample(tick * tick_s, requests=0.0))
        long = history.series()["ranges"][1]
        assert len(long["t"]) == 4, tick_s  # samples at ticks 0, 5, 10, 15, 20


def test_series_of_one_range_and_a_range_not_offered() -> None:
    history = StatsHistory(interval_s=2.0, horizon_s=3600.0)
    for tick in range(7):
        history.add(_sample(2.0 * tick, requests=0.0))
    only = history.series(range_s=3600.0)
    assert [r["span_s"] for r in only["ranges"]] == [3600.0]
    assert only["ranges"][0]["t"] == [1010.0, 1012.0]  # 0 -> 10 s, then the trailing 10 -> 12 s
    with pytest.raises(ValueError, match="300.0, 3600.0"):
        history.series(range_s=60.0)
    # a history no longer than the short range has that range alone
    assert StatsHistory(interval_s=2.0, horizon_s=120.0).ranges_s == (120.0,)


def test_a_model_new_in_the_long_range_is_zero_filled_before_it_appears() -> None:
    history = StatsHistory(interval_s=2.0, horizon_s=3600.0)
    for tick in range(11):
        history.add(_sample(2.0 * tick, requests=4.0 * tick, models=("a", "b") if tick >= 6 else ("a",)))
    long = history.series()["ranges"][1]
    # b appears at 12 s: absent from the 10-s sample, it counts from 0 there: 40 requests by 20 s -> 4 per s
    assert long["models"]["b"]["request_rate"] == [0.0, 4.0]
    assert long["models"]["a"]["tokens_per_s"] == {"prompt": [0.0, 0.0], "cached": [0.0, 0.0],
                                                  "completion": [0.0, 0.0]}
    assert long["models"]["a"]["error_rate"] == [None, None]  # no answers: no rate, not 0


def test_collect_totals_reads_the_gateway_metrics_and_skips_no_replica_decisions() -> None:
    metrics = RouterMetrics()
    metrics.requests.labels("a", "r1", "success").inc(3)
    metrics.requests.labels("a", "", "no_capacity").inc(2)
    metrics.decisions.labels("a", "no_replica").inc(5)
    metrics.decisions.labels("a", "rendezvous").inc(1)
    totals = collect_totals(metrics, ["a", "b"], {"a": 77.0}, {"a": (4, 1, 2)}, {"b": 1})
    assert totals["a"].requests == 5 and totals["a"].prompt_tokens == 77.0
    assert totals["a"].decisions == {"rendezvous": 1.0}
    assert (totals["a"].queue_depth, totals["a"].in_flight, totals["a"].ready) == (4, 1, 2)
    assert totals["b"] == ModelTotals(desired=1)


def test_collect_totals_reads_answers_refusals_tokens_and_requests_per_adapter() -> None:
    metrics = RouterMetrics()
    for code, n in (("2xx", 7), ("4xx", 1), ("5xx", 2)):
        metrics.answers.labels("a", code).inc(n)
    metrics.answers.labels("_unknown", "4xx").inc(3)  # requests naming no declared model
    metrics.refused_requests.labels("_unknown", "unknown_model", "404", "_open").inc(3)
    metrics.refused_requests.labels("a", "no_capacity", "503", "_open").inc(1)
    metrics.refused_requests.labels("a", "no_capacity", "503", "team-b").inc(1)
    metrics.tokens.labels("a", "", "prompt").inc(500)
    metrics.tokens.labels("a", "sql", "prompt").inc(120)
    metrics.tokens.labels("a", "sql", "completion").inc(30)
    metrics.tenant_requests.labels("_open", "a", "success").inc(6)
    metrics.tenant_requests.labels("team-b", "a", "upstream_5xx").inc(1)
    metrics.tenant_requests.labels("_open", "sql", "success").inc(2)
    metrics.tenant_requests.labels("_open", "gone-adapter", "success").inc(9)  # no longer declared: not shown
    totals = collect_totals(metrics, ["a", "b"], {}, {}, {})
    assert totals["a"].answers == {"2xx": 7, "4xx": 1, "5xx": 2}
    assert totals["a"].refused == {"no_capacity": 2}  # summed over status and tenant
    assert totals["a"].tokens == {"": {"prompt": 500}, "sql": {"prompt": 120, "completion": 30}}
    assert totals["a"].adapter_requests == {"": 7, "sql": 2}
    assert totals["_unknown"].answers == {"4xx": 3} and totals["_unknown"].refused == {"unknown_model": 3}
    assert totals["b"] == ModelTotals()


def test_a_replica_gone_for_the_grace_period_loses_its_series_and_its_counts_stay_in_the_totals() -> None:
    metrics = RouterMetrics()
    metrics.requests.labels("a", "r1", "success").inc(3)
    metrics.requests.labels("a", "r1", "upstream_error").inc(1)
    metrics.requests.labels("a", "r2", "success").inc(2)
    metrics.requests.labels("a", "", "no_capacity").inc(4)  # no replica: never retired

    def series() -> set[tuple[str, str]]:
        return {(s.labels["replica"], s.labels["outcome"]) for m in metrics.requests.collect() for s in m.samples
                if s.name.endswith("_total")}

    assert metrics.retire_replicas({"r2"}, now=100.0, after_s=600.0) == []  # r1 first seen gone
    assert metrics.retire_replicas({"r2"}, now=699.0, after_s=600.0) == []
    assert metrics.retire_replicas({"r2"}, now=700.0, after_s=600.0) == ["r1"]
    assert series() == {("r2", "success"), ("", "no_capacity")}
    assert collect_totals(metrics, ["a"], {}, {}, {})["a"].requests == 10  # r1's 4 moved to retired_requests
    metrics.requests.labels("a", "r1", "success").inc()  # it came back: a new series from 0, exported
    assert ("r1", "success") in series()
    assert metrics.retire_replicas({"r1", "r2"}, now=800.0, after_s=600.0) == []
    assert collect_totals(metrics, ["a"], {}, {}, {})["a"].requests == 11
    # Gone, back before the grace period ended, gone again: the period starts over.
    assert metrics.retire_replicas({"r2"}, now=900.0, after_s=600.0) == []
    assert metrics.retire_replicas({"r1", "r2"}, now=1000.0, after_s=600.0) == []
    assert metrics.retire_replicas({"r2"}, now=1100.0, after_s=600.0) == []
    assert metrics.retire_replicas({"r2"}, now=1600.0, after_s=600.0) == []
    assert metrics.retire_replicas({"r2"}, now=1700.0, after_s=600.0) == ["r1"]


async def test_sampler_task_survives_a_closed_store() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    store = MemoryStateStore(clock)
    await store.close()  # every read now raises StateStoreUnavailable
    dash = _dashboard(clock, metrics, store=store)
    task = asyncio.create_task(dash.run_sampler())
    await clock.advance(6.0)
    assert not task.done()
    assert len(dash.history) == 4  # at 0, 2, 4 and 6 s
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# ------------------------------------------------------------------------ served by a real gateway


def test_the_page_is_self_contained() -> None:
    page = dashboard_page()
    assert "<svg" in page or "drawChart" in page
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", page), "the page loads an external asset"
    assert not re.search(r"https?://", page), "the page names a remote URL"
    assert "@import" not in page


async def test_gateway_serves_the_page_and_admin_endpoints_need_the_token(tmp_path: Path) -> None:
    async with dashboard_stack(tmp_path, admin_token="s3cret", num_replicas=1) as stack:
        async with aiohttp.ClientSession() as s:
            async with s.get(stack.url + "/dashboard") as r:
                assert r.status == 200 and r.content_type == "text/html"
                assert "kvgate" in await r.text()
            for path in ("/admin/stats", "/admin/history"):
                async with s.get(stack.url + path) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["code"] == "invalid_admin_token"
        history = await stack.get_json("/admin/history")
        assert history["interval_s"] == 0.5 and history["horizon_s"] == 3600.0
        assert [(r["span_s"], r["step_s"]) for r in history["ranges"]] == [(300.0, 0.5), (3600.0, 10.0)]
        hour = await stack.get_json("/admin/history?range_s=3600")  # what the page polls: the range it shows
        assert [r["span_s"] for r in hour["ranges"]] == [3600.0]
        async with aiohttp.ClientSession() as s:
            for bad in ("600", "soon"):
                async with s.get(stack.url + f"/admin/history?range_s={bad}", headers=stack.headers()) as r:
                    error = (await r.json())["error"]
                    assert r.status == 400 and error["param"] == "range_s" and "300, 3600" in error["message"]


async def test_admin_stats_carries_windows_placement_and_the_autoscaler_record(tmp_path: Path) -> None:
    async with dashboard_stack(tmp_path, num_replicas=2) as stack:
        stats = await stack.get_json("/admin/stats")
        assert stats["autoscaler"] is None  # no record yet: the page says "no autoscaler"
        async with aiohttp.ClientSession() as s:
            first = await stack.chat(s, "question 0")  # puts the shared system prompt in one replica's cache
            statuses = [first] + list(await asyncio.gather(*(stack.chat(s, f"question {i}") for i in range(1, 12))))
        assert statuses == [200] * 12
        traffic_over = (await stack.get_json("/admin/stats"))["wall"]

        async def two_samples_after_the_traffic() -> bool:
            short = (await stack.get_json("/admin/history"))["ranges"][0]
            return sum(t > traffic_over for t in short["t"]) >= 2
        await eventually(two_samples_after_the_traffic, "two history samples after the traffic")
        await write_autoscaler_status(stack.store, wall=stats["wall"], desired=3, ready=2)
        stats = await stack.get_json("/admin/stats")
    chat = stats["models"][MODEL]
    assert chat["requests_total"] == 12
    assert chat["window"]["request_rate"] > 0
    assert chat["window"]["ttft_p50_s"] is not None
    assert chat["window"]["realised_hit_rate"] > 0  # one shared system prompt: later requests hit
    assert chat["desired"] == 3
    assert {(r["replica_id"], r["pool"], r["node"]) for r in chat["replicas"]} == {
        ("sim-0", "local", "node-a"), ("sim-1", "local", "node-a")}
    # the sims report vLLM's KV block count: the traffic is over, so no running request holds a block
    assert [r["kv_usage"] for r in chat["replicas"]] == [0.0, 0.0]
    assert stats["autoscaler"]["models"][MODEL]["reason"] == "queue 6 / target 2"
    assert stats["models"]["idle"]["window"]["request_rate"] == 0.0


async def test_admin_stats_and_history_carry_errors_tokens_adapters_and_request_ids(tmp_path: Path) -> None:
    """4 base-model requests (one with its own X-Request-Id), 2 for the adapter (one streamed), and one naming no
    declared model, which the gateway refuses with a 404: 7 answers, 6 of them 2xx."""
    async with dashboard_stack(tmp_path, num_replicas=1) as stack:
        async with aiohttp.ClientSession() as s:
            statuses = [await stack.chat(s, "find me", request_id="ops-search-0042")]
            statuses += await asyncio.gather(*(stack.chat(s, f"question {i}") for i in range(3)),
                                             stack.chat(s, "sql 0", model=ADAPTER),
                                             stack.chat(s, "sql 1", model=ADAPTER, stream=True),
                                             stack.chat(s, "who?", model="no-such-model"))
        assert statuses == [200] * 6 + [404]
        traffic_over = (await stack.get_json("/admin/stats"))["wall"]

        async def two_samples_after_the_traffic() -> bool:
            short = (await stack.get_json("/admin/history"))["ranges"][0]
            return sum(t > traffic_over for t in short["t"]) >= 2
        await eventually(two_samples_after_the_traffic, "two history samples after the traffic")
        stats = await stack.get_json("/admin/stats")
        history = await stack.get_json("/admin/history")
    chat = stats["models"][MODEL]
    assert chat["answers_total"] == {"2xx": 6, "4xx": 0, "5xx": 0, "stream_error": 0, "client_gone": 0}
    assert stats["refused_total"] == {"_unknown": {"unknown_model": 1}}
    base, sql = chat["by_adapter"]
    assert (base["adapter"], base["requests_total"], sql["adapter"], sql["requests_total"]) == ("", 4, ADAPTER, 2)
    # the sims report usage (a stream in its usage chunk): every answer's completion tokens count, 4 each at most
    assert 0 < sql["tokens_total"]["completion"] <= 8 and base["tokens_total"]["prompt"] > 0
    assert chat["window"]["token_rates"]["completion"] > 0 and chat["window"]["error_rate"] == 0.0
    # the refusal is the unknown model's: 1 answer, a 4xx; in the short range it is a model of its own
    unknown = history["ranges"][0]["models"]["_unknown"]
    assert 1.0 in unknown["client_error_rate"] and set(unknown["error_rate"]) <= {None, 0.0}
    assert max(history["ranges"][0]["models"][MODEL]["tokens_per_s"]["completion"]) > 0
    # the request-id search reads the decisions ring: the id the client sent names its decision
    found = [d for d in stats["recent_decisions"] if d["request_id"] == "ops-search-0042"]
    assert [(d["model"], d["replica"], d["attempt"]) for d in found] == [(MODEL, "sim-0", 0)]


def _page_constant(name: str) -> dict[str, str]:
    """A `const NAME = {key: "value", ...};` object of the page's script, as a dict."""
    body = re.search(rf"const {name} = \{{(.*?)\}};", dashboard_page(), re.S)
    assert body is not None, name
    return dict(re.findall(r'(\w+): "([^"]*)"', body.group(1)))


def test_every_routing_reason_has_a_colour_of_its_own_far_from_every_other() -> None:
    colours = _page_constant("REASON_COLORS")
    assert set(colours) == {r.value for r in Reason if r is not Reason.NO_REPLICA}
    assert set(_page_constant("REASON_LABELS")) == set(colours)

    def rgb(hex_colour: str) -> tuple[int, ...]:
        return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))

    # 80 apart in RGB at least: the old pairs an operator could not tell apart were 42 (rendezvous #58a6ff, round
    # robin #79c0ff) and 44 (least load #d29922, consistent hash #e3b341) apart
    for a, b in itertools.combinations(colours, 2):
        distance = math.dist(rgb(colours[a]), rgb(colours[b]))
        assert distance >= 80, f"{a} {colours[a]} and {b} {colours[b]} are {distance:.0f} apart"
