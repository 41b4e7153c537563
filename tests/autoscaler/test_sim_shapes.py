"""The synthetic trace shapes (`autoscaler/sim/shapes.py`): each has its mean rate and the structure it names,
and a shape and a seed always give the same trace."""

from __future__ import annotations

import statistics

import pytest

from kvgate.autoscaler.sim.shapes import SHAPES, ShapeSpec, shaped_trace
from kvgate.autoscaler.sim.traces import Trace

SPEC = ShapeSpec(duration_s=3600.0, mean_rps=4.0, seed=1)


def per_minute(trace: Trace, duration_s: float = SPEC.duration_s) -> list[int]:
    counts = [0] * int(duration_s // 60)
    for request in trace.requests:
        counts[min(len(counts) - 1, int(request.arrival_s // 60))] += 1
    return counts


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shape_has_its_mean_rate_and_repeats_for_a_seed(name: str) -> None:
    trace = shaped_trace(name, SPEC)
    mean = len(trace.requests) / SPEC.duration_s
    # mmpp's on/off phases are minutes long: an hour holds few of them, so its mean wanders more
    assert mean == pytest.approx(4.0, rel=0.35 if name == "mmpp" else 0.08)
    assert trace == shaped_trace(name, SPEC) and trace != shaped_trace(name, ShapeSpec(seed=2))
    assert all(0 <= r.arrival_s < SPEC.duration_s for r in trace.requests)


def test_mmpp_is_idle_between_bursts_at_three_times_the_mean() -> None:
    minutes = per_minute(shaped_trace("mmpp", SPEC))
    assert minutes.count(0) >= 15  # whole idle minutes
    assert max(minutes) >= 2.5 * 4.0 * 60  # bursts at about 3x the mean


def test_diurnal_peaks_about_four_times_its_trough() -> None:
    minutes = per_minute(shaped_trace("diurnal", SPEC))
    smoothed = [statistics.mean(minutes[i:i + 5]) for i in range(len(minutes) - 4)]
    assert 3.0 <= max(smoothed) / min(smoothed) <= 5.5


def test_the_mixes_differ_in_their_sizes() -> None:
    prefill, decode = shaped_trace("prefill-heavy", SPEC).requests, shaped_trace("decode-heavy", SPEC).requests
    assert statistics.median(r.input_tokens for r in prefill) == pytest.approx(2000, rel=0.1)
    assert statistics.median(r.output_tokens for r in prefill) == pytest.approx(30, rel=0.15)
    assert statistics.median(r.input_tokens for r in decode) == pytest.approx(200, rel=0.1)
    assert statistics.median(r.output_tokens for r in decode) == pytest.approx(600, rel=0.1)


def test_a_ramp_grows_steadily() -> None:
    minutes = per_minute(shaped_trace("ramp", SPEC))
    tenths = [sum(minutes[i:i + 6]) for i in range(0, 60, 6)]
    assert tenths[-1] > 8 * tenths[0]
    assert sum(later > earlier for earlier, later in zip(tenths, tenths[1:])) >= 8


def test_a_flash_crowd_is_eight_times_the_base_for_five_minutes_from_a_third_in() -> None:
    minutes = per_minute(shaped_trace("flash-crowd", SPEC))
    base = statistics.mean(minutes[:19])
    assert statistics.mean(minutes[21:25]) == pytest.approx(8 * base, rel=0.2)
    assert statistics.mean(minutes[31:]) == pytest.approx(base, rel=0.2)


def test_an_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="choose from mmpp, diurnal"):
        shaped_trace("sawtooth")
