"""Who goes next while a model is saturated (`router.fair_queue`): priority bands, weighted fair queuing between
tenants, and the bookkeeping the shell relies on."""

from __future__ import annotations

import collections

from kvgate.router.fair_queue import FairQueue, Flow

NOISY, QUIET = Flow("noisy"), Flow("quiet")


def drain(queue: FairQueue) -> list[str]:
    order = []
    while (ticket := queue.pop()) is not None:
        order.append(ticket.flow.tenant)
    return order


def test_a_tenant_arriving_behind_a_burst_goes_next_not_last() -> None:
    queue = FairQueue()
    for _ in range(10):
        queue.push(NOISY)
    queue.push(QUIET)
    assert drain(queue)[:3] == ["noisy", "quiet", "noisy"]


def test_a_single_tenant_is_served_first_come_first_served() -> None:
    queue = FairQueue()
    tickets = [queue.push(NOISY) for _ in range(5)]
    assert [queue.pop() for _ in range(5)] == tickets


def test_weights_share_a_backlog_in_their_ratio() -> None:
    queue = FairQueue()
    for _ in range(300):
        queue.push(Flow("gold", weight=2.0))
        queue.push(Flow("bronze", weight=1.0))
    served = collections.Counter(drain(queue)[:150])
    assert served == {"gold": 100, "bronze": 50}


def test_a_higher_priority_always_goes_first() -> None:
    queue = FairQueue()
    queue.push(Flow("batch", priority=-1))
    queue.push(NOISY)
    queue.push(Flow("urgent", priority=5))
    assert drain(queue) == ["urgent", "noisy", "batch"]


def test_requests_ahead_count_the_higher_bands_and_the_smaller_tags_of_its_own() -> None:
    queue = FairQueue()
    for _ in range(4):
        queue.push(NOISY)
    queue.push(Flow("urgent", priority=1))
    quiet = queue.push(QUIET)  # tag 1: behind noisy's first (tag 1, earlier), before its other three
    assert queue.ahead_of(quiet) == 2


def test_a_removed_request_is_never_served_and_the_depths_follow() -> None:
    queue = FairQueue()
    first, second = queue.push(NOISY), queue.push(QUIET)
    assert queue.depth_by_tenant() == {"noisy": 1, "quiet": 1}
    assert queue.remove(first) and not queue.remove(first)
    assert queue.depth_by_tenant() == {"quiet": 1} and len(queue) == 1
    assert queue.pop() is second and queue.pop() is None and queue.depth_by_tenant() == {}


def test_the_last_of_the_lowest_band_is_the_one_shed_to_make_room() -> None:
    queue = FairQueue()
    queue.push(Flow("batch", priority=-1))
    last = queue.push(Flow("batch", priority=-1))
    queue.push(Flow("urgent", priority=1))
    assert queue.last_of_lowest() is last


def test_an_idle_band_forgets_its_tags_so_a_returning_tenant_starts_even() -> None:
    queue = FairQueue()
    for _ in range(50):
        queue.push(NOISY)
    drain(queue)
    queue.push(NOISY)
    queue.push(QUIET)
    assert drain(queue) == ["noisy", "quiet"]  # not quiet first: noisy's old backlog is not held against it


def test_removed_entries_do_not_pile_up_in_a_band_that_never_empties() -> None:
    queue = FairQueue()
    queue.push(QUIET)  # keeps the band alive
    for _ in range(10_000):
        queue.remove(queue.push(NOISY))
    assert sum(map(len, queue._bands[0].queues.values())) < 200  # noqa: SLF001 - the bound is the point


def test_an_ineligible_tenant_is_passed_over_for_the_next_in_order() -> None:
    queue = FairQueue()
    for _ in range(3):
        queue.push(NOISY)
    queue.push(QUIET)
    queue.push(Flow("batch", priority=-1))
    assert queue.pop(lambda flow: flow.tenant != "noisy").flow.tenant == "quiet"
    assert queue.pop(lambda flow: flow.tenant != "noisy").flow.tenant == "batch"  # a lower band's, then
    assert queue.pop(lambda flow: flow.tenant != "noisy") is None and len(queue) == 3
