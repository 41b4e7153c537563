"""What nearly every recent request of a model opens with (`router.common_openings`)."""

from __future__ import annotations

import pytest

from kvgate.router.common_openings import CommonOpenings


def chain(*labels: str) -> tuple[int, ...]:
    """A stand-in chain: each hash folds in the labels before it, as chain hashes do."""
    return tuple(hash(labels[:i + 1]) for i in range(len(labels)))


def test_the_opening_at_least_the_share_of_recent_requests_open_with_is_common() -> None:
    # The module's worked example: window 256, share 0.9; every request opens with a, b, c and one in ten
    # also with d.
    openings = CommonOpenings(window=256, share=0.9, min_requests=64)
    for i in range(256):
        openings.observe("m", chain("a", "b", "c", "d" if i % 10 == 0 else f"own{i}", "tail"))
    assert openings.observe("m", chain("a", "b", "c", "d", "more")) == 3
    assert openings.observe("m", chain("a", "b", "x")) == 2  # shares only two of the three
    assert openings.observe("m", chain("z")) == 0
    assert openings.observe("other", chain("a", "b", "c")) == 0  # per model


def test_nothing_is_common_before_enough_requests_and_a_hot_prompt_half_share_never_is() -> None:
    openings = CommonOpenings(window=256, share=0.9, min_requests=64)
    assert all(openings.observe("m", chain("sys", f"q{i}")) == 0 for i in range(63))  # a first burst says little
    assert openings.observe("m", chain("sys", "q63")) == 1
    hot = CommonOpenings(window=256, share=0.9, min_requests=64)
    for i in range(300):  # a hot prompt in 55% of requests: what routing follows, not common
        hot.observe("m", chain("hot", f"q{i}") if i % 20 < 11 else chain(f"conversation{i % 30}", "turn"))
    assert hot.observe("m", chain("hot", "q")) == 0


def test_the_share_is_over_the_last_window_requests_only() -> None:
    openings = CommonOpenings(window=100, share=0.9, min_requests=10)
    for i in range(100):
        openings.observe("m", chain("old", f"q{i}"))
    assert openings.observe("m", chain("old", "q")) == 1
    for i in range(100):  # the traffic moved on to a new opening: the old one ages out of the window
        openings.observe("m", chain("new", f"q{i}"))
    assert openings.observe("m", chain("old", "q")) == 0
    assert openings.observe("m", chain("new", "q")) == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        CommonOpenings(share=0)
    with pytest.raises(ValueError):
        CommonOpenings(window=0)
