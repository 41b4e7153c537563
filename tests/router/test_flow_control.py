"""The gate in front of a saturated model (`router.flow_control`) on a fake clock: straight through below
capacity, a fair wait at it, the lowest priority shed first, and no place ever lost or counted twice."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvgate.clock import FakeClock
from kvgate.openai_wire import ApiError
from kvgate.router.fair_queue import Flow
from kvgate.router.flow_control import FlowGate

NOISY, QUIET = Flow("noisy"), Flow("quiet")
BUDGET_S, MAX_QUEUED = 10.0, 100


class Capacity:
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


def gate_of(clock: FakeClock, capacity: float) -> tuple[FlowGate, Capacity]:
    cap = Capacity(capacity)
    return FlowGate("m", clock, cap), cap


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_below_capacity_a_request_goes_straight_on() -> None:
    gate, _ = gate_of(FakeClock(), 2)
    permits = [await gate.enter(NOISY, BUDGET_S, MAX_QUEUED) for _ in range(2)]
    assert gate.active == 2 and gate.depth == 0 and len(permits) == 2


async def test_an_unknown_capacity_lets_everything_through() -> None:
    gate, _ = gate_of(FakeClock(), math.inf)
    for _ in range(100):
        await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    assert gate.depth == 0


async def test_at_capacity_requests_wait_and_the_quiet_tenant_goes_before_the_noisy_backlog() -> None:
    clock = FakeClock()
    gate, _ = gate_of(clock, 1)
    running = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    order: list[str] = []

    async def wait(flow: Flow) -> None:
        permit = await gate.enter(flow, BUDGET_S, MAX_QUEUED)
        order.append(flow.tenant)
        await clock.sleep(1)
        gate.leave(permit)

    tasks = [asyncio.ensure_future(wait(NOISY)) for _ in range(3)]
    await settle()
    tasks.append(asyncio.ensure_future(wait(QUIET)))
    await settle()
    assert gate.depth == 4
    gate.leave(running)
    for _ in range(5):
        await clock.advance(1)
    await asyncio.gather(*tasks)
    assert order == ["noisy", "quiet", "noisy", "noisy"] and gate.active == 0 and gate.depth == 0


async def test_a_wait_predicted_past_the_budget_is_shed_at_once_with_retry_after() -> None:
    clock = FakeClock()
    gate, _ = gate_of(clock, 2)
    first = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    await clock.advance(4)
    gate.leave(first)  # requests hold their place 4 s: 2 places free up every 4 s
    held = [await gate.enter(NOISY, BUDGET_S, MAX_QUEUED) for _ in range(2)]
    # The 5th to wait is predicted (4 ahead + 1) x 4 / 2 = 10 s: not past the budget; the 6th, 12 s, is.
    waiting = [asyncio.ensure_future(gate.enter(NOISY, BUDGET_S, MAX_QUEUED)) for _ in range(5)]
    await settle()
    assert gate.depth == 5
    with pytest.raises(ApiError) as shed:
        await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    error = shed.value
    assert (error.status, error.code) == (503, "model_overloaded") and int(error.headers["Retry-After"]) >= 12
    assert gate.depth == 5 and gate.active == 2
    for task in waiting:
        task.cancel()
    for permit in held:
        gate.leave(permit)


async def test_a_request_still_waiting_when_its_budget_runs_out_is_shed_and_leaves_the_queue() -> None:
    clock = FakeClock()
    gate, _ = gate_of(clock, 1)
    held = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    waiting = asyncio.ensure_future(gate.enter(QUIET, BUDGET_S, MAX_QUEUED))
    await settle()
    await clock.advance(BUDGET_S)
    with pytest.raises(ApiError) as shed:
        await waiting
    assert shed.value.code == "model_overloaded" and gate.depth == 0
    gate.leave(held)
    assert gate.active == 0


async def test_a_full_queue_sheds_its_lowest_priority_for_a_higher_one() -> None:
    clock = FakeClock()
    gate, _ = gate_of(clock, 1)
    held = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    low = [asyncio.ensure_future(gate.enter(Flow("batch", priority=-1), BUDGET_S, 2)) for _ in range(2)]
    await settle()
    urgent = asyncio.ensure_future(gate.enter(Flow("urgent", priority=1), BUDGET_S, 2))
    await settle()
    assert low[1].done() and low[1].exception().code == "model_overloaded"  # the last of the lowest
    with pytest.raises(ApiError):  # the queue is full of priority >= its own: the arrival is shed
        await gate.enter(Flow("batch", priority=-1), BUDGET_S, 2)
    gate.leave(held)
    await settle()
    assert urgent.done() and not low[0].done()
    gate.leave(urgent.result())
    await settle()
    gate.leave(low[0].result())
    assert gate.active == 0 and gate.depth == 0


async def test_a_client_that_goes_away_while_waiting_takes_no_place() -> None:
    clock = FakeClock()
    gate, _ = gate_of(clock, 1)
    held = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    gone = asyncio.ensure_future(gate.enter(QUIET, BUDGET_S, MAX_QUEUED))
    await settle()
    gone.cancel()
    await settle()
    assert gate.depth == 0
    gate.leave(held)
    assert gate.active == 0


async def test_a_client_that_goes_away_as_its_place_is_granted_gives_it_back() -> None:
    clock = FakeClock()
    gate, _ = gate_of(clock, 1)
    held = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    gone = asyncio.ensure_future(gate.enter(QUIET, BUDGET_S, MAX_QUEUED))
    await settle()
    gate.leave(held)  # grants the waiter its place ...
    gone.cancel()  # ... in the same instant its client goes
    await asyncio.gather(gone, return_exceptions=True)
    assert gate.active == 0


async def test_a_capacity_that_grows_sends_on_what_now_fits() -> None:
    clock = FakeClock()
    gate, capacity = gate_of(clock, 1)
    await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    waiting = [asyncio.ensure_future(gate.enter(NOISY, BUDGET_S, MAX_QUEUED)) for _ in range(3)]
    await settle()
    capacity.value = 3  # a replica became ready
    gate.dispatch()
    await settle()
    assert [task.done() for task in waiting] == [True, True, False] and gate.active == 3
    waiting[2].cancel()


async def test_the_wait_budget_leaves_room_for_the_time_to_the_first_token() -> None:
    # A place granted, then 1.5 s to the first token: of a 10 s SLO, 8.5 s are left for waiting.
    clock = FakeClock()
    gate, _ = gate_of(clock, 1)
    held = await gate.enter(NOISY, BUDGET_S, MAX_QUEUED)
    await clock.advance(1.5)
    gate.first_token(held, clock.now())
    waiting = asyncio.ensure_future(gate.enter(QUIET, BUDGET_S, MAX_QUEUED))
    await settle()
    await clock.advance(8.5)
    with pytest.raises(ApiError):
        await waiting
    assert gate.mean_first_token_s == 1.5


async def test_places_freed_together_go_to_a_tenant_past_its_reservation_a_few_at_a_time() -> None:
    # Capacity 8: the quiet tenant runs 2 and 1 more place is held back for it (its peak + 1), the noisy tenant
    # runs 5. Requests hold a place 2 s and send their first token 0.5 s after it: a steady stream has
    # 8 / 2 x 0.5 = 2 before their first token, so past its reservation (4, its fair share) the noisy tenant may
    # start while fewer than 2 + 1 = 3 are there.
    clock = FakeClock()
    gate, _ = gate_of(clock, 8)
    quiet = [await gate.enter(QUIET, BUDGET_S, MAX_QUEUED) for _ in range(2)]
    held = [await gate.enter(NOISY, BUDGET_S, MAX_QUEUED) for _ in range(5)]
    for permit in [*quiet, *held]:
        gate.first_token(permit, clock.now() + 0.5)
    waiting = [asyncio.ensure_future(gate.enter(NOISY, BUDGET_S, MAX_QUEUED)) for _ in range(5)]
    await settle()
    assert not any(task.done() for task in waiting)
    await clock.advance(2.0)
    for permit in held:  # all 5 end in the same instant: 4 start (its reservation), not 5
        gate.leave(permit)
    await settle()
    started = [task.result() for task in waiting if task.done()]
    assert len(started) == 4 and gate.active == 6
    gate.first_token(started[0], clock.now())  # 3 still before their first token: none more yet
    await settle()
    assert sum(task.done() for task in waiting) == 4
    gate.first_token(started[1], clock.now())  # 2 left there: one more starts
    await settle()
    assert sum(task.done() for task in waiting) == 5 and gate.active == 7
    # the quiet tenant, under its reservation, is not held back by the noisy one's pace
    assert (await asyncio.wait_for(gate.enter(QUIET, BUDGET_S, MAX_QUEUED), 1)).flow == QUIET
