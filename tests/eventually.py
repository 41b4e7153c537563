"""Waiting for something in a test without racing the clock: poll a condition until it holds.

A fixed sleep before an assertion races what it waits for. On a loaded 2-core box the awaited thing
comes later than the sleep allows, and the test fails for no fault of the code; an assertion that
something did NOT happen passes before the thing could have happened, and the test proves nothing.
So a test waits for the positive signal itself (`eventually(lambda: tracker.num_ready("m") == 1)`),
and checks an absence only after a signal that what it depends on has happened.

The limit is generous (30 s against conditions that hold within a second on a quiet host): a passing
test never reaches it, and a failing one says what never became true instead of hanging until the
suite's timeout. Sleeps that are the point of a test (a real timeout being exercised) stay sleeps.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 30.0  # far past what any condition takes on a loaded host; only a failing test waits it out
Describe = str | Callable[[], str]  # what is awaited; a callable is asked only on failure (a log tail)


async def eventually(condition: Callable[[], T | Awaitable[T]], what: Describe = "",
                     timeout_s: float = TIMEOUT_S, poll_s: float = 0.01) -> T:
    """Poll `condition()` (plain or async) every `poll_s` on the event loop until it returns something
    truthy, and return that. After `timeout_s` the test fails with an AssertionError naming `what` (by
    default the condition's source line). An exception the condition raises propagates at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_never(condition, what, timeout_s, value))
        await asyncio.sleep(poll_s)


def eventually_sync(condition: Callable[[], T], what: Describe = "", timeout_s: float = TIMEOUT_S,
                    poll_s: float = 0.05) -> T:
    """`eventually` for synchronous tests (and threads): blocks between polls with `time.sleep`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(_never(condition, what, timeout_s, value))
        time.sleep(poll_s)
    return value


def _never(condition: Callable[[], object], what: Describe, timeout_s: float, last: object) -> str:
    said = what() if callable(what) else what
    if not said:
        try:
            said = inspect.getsource(condition).strip()
        except (OSError, TypeError):
            said = repr(condition)
    return f"never became true within {timeout_s:g} s: {said} (last value: {last!r})"
