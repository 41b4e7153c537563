"""`Outage`: what a loop that cannot reach the state store logs while it cannot, and when it can again."""

from __future__ import annotations

from kvgate.state.outage import Outage


def test_a_store_that_never_failed_has_nothing_to_report() -> None:
    outage = Outage()
    assert not outage.ongoing and outage.recovered(now=5.0) is None


def test_recovery_reports_the_time_since_the_first_failure_and_the_count_once() -> None:
    outage = Outage()
    for now in (100.0, 101.1, 102.2):  # three polls a second apart (plus the ~0.1 s each failed one took)
        outage.failed(now)
    assert outage.ongoing
    assert outage.recovered(now=103.3) == "after 3.3 s and 3 failed tries"
    assert not outage.ongoing and outage.recovered(now=104.4) is None  # said once


def test_one_failed_try_is_said_in_the_singular() -> None:
    outage = Outage()
    outage.failed(10.0)
    assert outage.recovered(11.0) == "after 1.0 s and 1 failed try"


def test_a_poll_a_second_is_logged_when_the_outage_starts_then_once_a_minute_with_the_count() -> None:
    outage = Outage(interval_s=60.0)
    notes = {t: outage.failed(float(t)) for t in range(150)}  # 150 failed polls, a second apart
    said = {t: note for t, note in notes.items() if note is not None}
    assert said == {0: "", 60: " (failing for 60 s; 59 more failed tries since the last line)",
                    120: " (failing for 120 s; 59 more failed tries since the last line)"}
    assert outage.recovered(150.0) == "after 150.0 s and 150 failed tries"  # every try counted, logged or not
    assert outage.failed(200.0) == ""  # a new outage is said at once
