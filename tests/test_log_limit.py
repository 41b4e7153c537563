"""`LogLimiter`: which events of a problem are logged, and what the logged ones say, on a fake timeline."""

from __future__ import annotations

import pytest

from kvgate.clock import FakeClock
from kvgate.log_limit import Ended, LogLimiter, Verdict


def said(limiter: LogLimiter, events: list[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """(time, key, note) of each event that is to be logged."""
    out = []
    for now, key in events:
        verdict = limiter.hit(key, now)
        if verdict is not None:
            out.append((now, key, verdict.note))
    return out


@pytest.mark.parametrize("events,expected", [
    # A store polled every second for 5 minutes, 60 s interval: t=0, then the first poll 60 s after each line.
    ([(float(t), "store") for t in range(300)],
     [(0.0, "store", "")] + [(t, "store", " (59 more in the last 60 s)") for t in (60.0, 120.0, 180.0, 240.0)]),
    # Events 25 s apart: the next one after 60 s is logged, the two in between counted.
    ([(0.0, "a"), (25.0, "a"), (50.0, "a"), (75.0, "a")], [(0.0, "a", ""), (75.0, "a", " (2 more in the last 75 s)")]),
    # Rare events (one an hour) are each logged, with nothing suppressed to report.
    ([(0.0, "a"), (3600.0, "a"), (7200.0, "a")], [(0.0, "a", ""), (3600.0, "a", ""), (7200.0, "a", "")]),
    # Kinds are limited apart: a flood of one does not hide the first of another.
    ([(0.0, "a"), (1.0, "a"), (2.0, "b"), (3.0, "a"), (4.0, "b"), (61.0, "a")],
     [(0.0, "a", ""), (2.0, "b", ""), (61.0, "a", " (2 more in the last 61 s)")]),
])
def test_the_first_event_of_a_key_is_logged_then_one_a_minute_with_the_count(
        events: list[tuple[float, str]], expected: list[tuple[float, str, str]]) -> None:
    assert said(LogLimiter(interval_s=60.0), events) == expected


def test_a_verdict_says_whether_it_is_a_first_and_how_long_the_problem_has_lasted() -> None:
    limiter = LogLimiter(interval_s=10.0)
    assert limiter.hit("k", 100.0) == Verdict(first=True, num_suppressed=0, since_s=0.0, ongoing_s=0.0)
    assert limiter.hit("k", 105.0) is None
    assert limiter.hit("k", 112.0) == Verdict(first=False, num_suppressed=1, since_s=12.0, ongoing_s=12.0)
    assert limiter.hit("k", 125.0) == Verdict(first=False, num_suppressed=0, since_s=13.0, ongoing_s=25.0)


async def test_clear_ends_a_problem_once_with_its_duration_and_count_on_a_fake_clock() -> None:
    clock, limiter = FakeClock(start=100.0), LogLimiter(interval_s=60.0)
    assert limiter.clear("store", clock.now()) is None  # nothing was wrong
    for _ in range(12):  # a poll a second, failing
        limiter.hit("store", clock.now())
        await clock.advance(1.0)
    assert limiter.ongoing("store")
    assert limiter.clear("store", clock.now()) == Ended(duration_s=12.0, num_events=12)
    assert not limiter.ongoing("store") and limiter.clear("store", clock.now()) is None  # said once
    assert limiter.hit("store", clock.now()).first  # it fails again: a new outage, said at once


def test_clear_all_ends_every_kind_from_the_earliest() -> None:
    limiter = LogLimiter(interval_s=60.0)
    for now, key in [(10.0, "refused"), (11.0, "refused"), (15.0, "timeout")]:
        limiter.hit(key, now)
    assert limiter.clear_all(20.0) == Ended(duration_s=10.0, num_events=3)
    assert len(limiter) == 0 and limiter.clear_all(21.0) is None


def test_keys_are_capped_dropping_the_least_recently_hit() -> None:
    limiter = LogLimiter(interval_s=60.0, max_keys=2)
    limiter.hit("a", 0.0)
    limiter.hit("b", 1.0)
    limiter.hit("a", 2.0)  # "a" is now the most recent
    limiter.hit("c", 3.0)  # room for "c": "b" goes
    assert len(limiter) == 2 and limiter.ongoing("a") and limiter.ongoing("c") and not limiter.ongoing("b")
    assert limiter.hit("b", 4.0).first  # a dropped key starts over


def test_an_interval_of_zero_logs_every_event() -> None:
    limiter = LogLimiter(interval_s=0.0)
    assert all(limiter.hit("a", float(t)) is not None for t in range(5))


@pytest.mark.parametrize("interval_s,max_keys", [(-1.0, 10), (60.0, 0)])
def test_a_negative_interval_or_no_room_is_refused(interval_s: float, max_keys: int) -> None:
    with pytest.raises(ValueError):
        LogLimiter(interval_s=interval_s, max_keys=max_keys)
