"""`tests.eventually`: the suite's one way to wait for a condition instead of sleeping."""

from __future__ import annotations

import pytest

from tests.eventually import eventually, eventually_sync


async def test_it_returns_the_first_truthy_value_of_a_plain_condition() -> None:
    calls = iter([None, [], {"ready": 1}])
    assert await eventually(lambda: next(calls)) == {"ready": 1}


async def test_it_awaits_an_async_condition() -> None:
    polls = []

    async def third_time() -> int:
        polls.append(1)
        return len(polls) if len(polls) == 3 else 0
    assert await eventually(third_time) == 3


async def test_a_condition_that_never_holds_fails_naming_what_was_awaited() -> None:
    with pytest.raises(AssertionError, match=r"within 0.05 s: the replica to drain \(last value: 0\)"):
        await eventually(lambda: 0, "the replica to drain", timeout_s=0.05)


async def test_without_a_description_the_failure_quotes_the_condition() -> None:
    with pytest.raises(AssertionError, match=r"lambda: 1 == 2"):
        await eventually(lambda: 1 == 2, timeout_s=0.05)


async def test_a_description_that_is_callable_is_asked_only_on_failure() -> None:
    asked = []
    assert await eventually(lambda: True, lambda: asked.append(1) or "log")
    assert asked == []
    with pytest.raises(AssertionError, match="the log tail"):
        await eventually(lambda: False, lambda: "the log tail", timeout_s=0.05)


async def test_an_exception_in_the_condition_propagates_at_once() -> None:
    def exited() -> bool:
        raise AssertionError("the process exited")
    with pytest.raises(AssertionError, match="the process exited"):
        await eventually(exited, timeout_s=60)


def test_the_blocking_form_polls_the_same_way() -> None:
    calls = iter([False, False, "done"])
    assert eventually_sync(lambda: next(calls), poll_s=0.001) == "done"
    with pytest.raises(AssertionError, match="never became true within 0.05 s: nothing"):
        eventually_sync(lambda: None, "nothing", timeout_s=0.05, poll_s=0.01)
