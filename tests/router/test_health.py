"""router.health: health checks take a replica out and back at once; request failures eject it for a while."""

from __future__ import annotations

import pytest

from kvgate.router.health import (Ejection, Health, after_check, after_request, newly_ejected, newly_unresponsive,
                                  unresponsive,
                                  readmitted)

EJECT = Ejection(after_failures=3, for_s=10.0)


@pytest.mark.parametrize(("before", "ok", "now", "after"), [
    (Health(), False, 0.0, Health(failed_checks=1)),  # one failed check: out of rotation at once
    (Health(failed_checks=2), False, 0.0, Health(failed_checks=3)),  # counts on in a row
    (Health(failed_checks=2), True, 0.0, Health()),  # one pass: back
    # ejected at t=100 until t=110: a pass before the end leaves it out, and keeps its failures counted
    (Health(consecutive_failures=3, ejected_until=110.0), True, 105.0,
     Health(consecutive_failures=3, ejected_until=110.0)),
    # the first pass at or after the end readmits it with a fresh run
    (Health(consecutive_failures=4, ejected_until=110.0), True, 110.0, Health()),
    # a failed check after the end readmits nothing
    (Health(consecutive_failures=3, ejected_until=110.0), False, 111.0,
     Health(failed_checks=1, consecutive_failures=3, ejected_until=110.0)),
])
def test_a_health_check_marks_the_replica_at_once_and_readmits_an_ejected_one_only_after_its_time(
        before: Health, ok: bool, now: float, after: Health) -> None:
    assert after_check(before, ok, now) == after


@pytest.mark.parametrize(("before", "ok", "after"), [
    (Health(), False, Health(consecutive_failures=1)),
    (Health(consecutive_failures=1), False, Health(consecutive_failures=2)),  # two in a row: still in
    (Health(consecutive_failures=2), False, Health(consecutive_failures=3, ejected_until=1010.0)),  # third: out 10 s
    (Health(consecutive_failures=2), True, Health()),  # a success ends the run
    # failing on while ejected counts, but does not push the end back
    (Health(consecutive_failures=3, ejected_until=1005.0), False, Health(consecutive_failures=4, ejected_until=1005.0)),
    (Health(failed_checks=1), False, Health(failed_checks=1, consecutive_failures=1)),  # checks are their own count
])
def test_the_third_request_failure_in_a_row_ejects_for_eject_for_s(before: Health, ok: bool, after: Health) -> None:
    assert after_request(before, ok, 1000.0, EJECT) == after


@pytest.mark.parametrize(("health", "in_rotation"), [
    (Health(), True),  # nothing checked yet: a new replica is routable at once
    (Health(consecutive_failures=2), True),  # request failures alone do not take it out
    (Health(failed_checks=1), False),
    (Health(ejected_until=5.0), False),
])
def test_a_replica_is_in_rotation_while_its_checks_pass_and_it_is_not_ejected(health: Health, in_rotation: bool) -> None:
    assert health.in_rotation is in_rotation


def test_ejection_and_readmission_are_the_changes_that_start_and_end_an_ejection() -> None:
    out, back = Health(consecutive_failures=3, ejected_until=10.0), Health()
    assert newly_ejected(back, out) and not newly_ejected(out, out) and not newly_ejected(out, back)
    assert readmitted(out, back) and not readmitted(back, back) and not readmitted(back, out)


@pytest.mark.parametrize(("before", "ok", "answered", "after"), [
    (Health(), False, False, Health(failed_checks=1, unanswered_checks=1)),  # no answer: a failed check too
    (Health(failed_checks=1, unanswered_checks=1), False, False, Health(failed_checks=2, unanswered_checks=2)),
    # an answer of any status ends the silence: a draining replica's 503 is not a frozen process
    (Health(failed_checks=2, unanswered_checks=2), False, True, Health(failed_checks=3)),
    (Health(failed_checks=2, unanswered_checks=2), True, True, Health()),
])
def test_checks_without_any_answer_are_counted_apart_from_checks_that_fail(
        before: Health, ok: bool, answered: bool, after: Health) -> None:
    assert after_check(before, ok, 0.0, answered) == after


def test_a_replica_is_unresponsive_from_its_second_unanswered_check_until_it_answers() -> None:
    assert [unresponsive(Health(unanswered_checks=n), after_checks=2) for n in (0, 1, 2, 3)] == [False, False, True, True]
    assert not unresponsive(after_check(Health(unanswered_checks=3), False, 0.0, answered=True), after_checks=2)


@pytest.mark.parametrize(("before", "after", "told"), [
    (Health(unanswered_checks=0), Health(unanswered_checks=1), False),  # out of rotation, its requests go on
    (Health(unanswered_checks=1), Health(unanswered_checks=2), True),  # the second silence in a row: give up
    (Health(unanswered_checks=2), Health(unanswered_checks=3), False),  # said once per silence (the log line)
    (Health(failed_checks=5), Health(failed_checks=6), False),  # answering 503 (draining): never
])
def test_the_news_is_new_once_per_silence_at_the_second_unanswered_check(
        before: Health, after: Health, told: bool) -> None:
    assert newly_unresponsive(before, after, after_checks=2) is told
