"""loadtests/soak_gateway.py: a short real soak (2 simulated replica processes, a real `kvgate router` with
PYTHONTRACEMALLOC) that records what the script says, and its pure helpers. The numbers are the hour-long run's
business (docs/benchmarks.md), not this test's."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from loadtests import soak_gateway
from loadtests.soak_gateway import Sample, slope_per_h, soak_request, table_rows, window_slopes
from loadtests.routing_fleet import MODEL


def sample(t_s: float, rss_mib: float, traced_mib: float | None = None) -> Sample:
    return Sample(t_s, rss_mib, traced_mib, None, 0.0, 0, 0, 0, 0, None, None)


def test_a_short_soak_samples_takes_a_baseline_and_names_the_sites_that_grew(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    soak_gateway.main(["--minutes", "0.3", "--rate", "20", "--sample-s", "2", "--baseline-s", "5",
                       "--snapshot-s", "6", "--out", str(out)])
    run = json.loads(out.read_text())
    summary, samples = run["summary"], run["samples"]
    assert summary["num_sent"] == 360 and summary["num_errors"] == 0, summary["error_kinds"]
    assert summary["num_refused_as_asked"] > 0  # the unknown models' 404s, not errors
    assert len(samples) >= 8 and all(s["rss_mib"] > 10 and s["traced_mib"] > 1 for s in samples)
    assert samples[-1]["num_done"] == 360 and samples[-1]["index_entries"] > 0
    assert run["baseline"]["tracing"] is True and run["baseline"]["num_sites"] > 1000
    assert run["snapshots"] and "growth" in run["snapshots"][-1] and len(run["snapshots"][-1]["top"]) == 40
    assert summary["slopes"]["rss_mib_per_h"] is not None
    assert out.with_suffix(".gateway.log").exists()


def test_the_mix_is_deterministic_and_as_documented() -> None:
    requests = [soak_request(i) for i in range(4_000)]
    assert [r.body for r in requests[:50]] == [soak_request(i).body for i in range(50)]
    kinds = collections.Counter(r.kind for r in requests)
    for kind, share in (("distinct", 0.55), ("shared", 0.25), ("completion", 0.10), ("adapter", 0.08),
                        ("unknown", 0.02)):
        assert kinds[kind] / len(requests) == pytest.approx(share, abs=0.02), kind
    distinct = [r.body["messages"][0]["content"] for r in requests if r.kind == "distinct"]
    assert len(set(distinct)) == len(distinct) and min(map(len, distinct)) >= 1500
    assert {r.path for r in requests if r.kind == "completion"} == {"/v1/completions"}
    assert all(r.body["model"] == MODEL for r in requests if r.kind in ("distinct", "shared", "completion"))
    assert len({r.body["model"] for r in requests if r.kind == "unknown"}) == kinds["unknown"]  # each new
    streamed = sum(bool(r.body.get("stream")) for r in requests) / len(requests)
    assert streamed == pytest.approx(0.5, abs=0.03)


def test_the_slope_is_least_squares_in_mib_per_hour() -> None:
    assert slope_per_h([(0.0, 76.0), (1800.0, 77.0), (3600.0, 78.0)]) == pytest.approx(2.0)
    assert slope_per_h([(0.0, 76.0)]) is None and slope_per_h([(5.0, 1.0), (5.0, 2.0)]) is None


def test_the_window_is_the_last_30_minutes_or_the_last_half_of_a_shorter_run() -> None:
    hour = [sample(t, 80.0 + (t >= 1800) * (t - 1800) / 3600) for t in range(0, 3601, 60)]
    slopes = window_slopes(hour)
    assert slopes["from_s"] == 1800 and slopes["rss_mib_per_h"] == pytest.approx(1.0)
    assert window_slopes([sample(t, 80.0) for t in range(0, 601, 10)])["from_s"] == 300


def test_the_table_spreads_its_rows_and_keeps_the_first_and_the_last() -> None:
    samples = [sample(t, 80.0) for t in range(100)]
    rows = table_rows(samples, 13)
    assert len(rows) == 13 and rows[0] is samples[0] and rows[-1] is samples[-1]
    assert table_rows(samples[:5], 13) == samples[:5]
