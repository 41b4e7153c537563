"""The gateway's observations for the autoscaler: arrival rates (pure) and the records it publishes."""

from __future__ import annotations

import collections

import pytest

from kvgate.clock import FakeClock
from kvgate.state.memory import MemoryStateStore
from kvgate.router.observations import OBSERVATIONS_COLLECTION, ArrivalRate, ArrivalSpread, ObservationPublisher, PromptWork


@pytest.mark.parametrize("samples,rate", [
    ([(0.0, 0)], 0.0),  # one sample: nothing to measure from
    ([(0.0, 0), (10.0, 30)], 3.0),  # 30 arrivals in 10 s
    # A 10 s window slides: at t=20 it measures from t=10 (count 30) -> (50 - 30) / 10 = 2.0
    ([(0.0, 0), (10.0, 30), (15.0, 40), (20.0, 50)], 2.0),
    ([(0.0, 5), (10.0, 2)], 0.0),  # a counter that went back (restart) never gives a negative rate
])
def test_arrival_rate_over_a_sliding_window(samples: list[tuple[float, int]], rate: float) -> None:
    arrivals = ArrivalRate(window_s=10.0)
    got = [arrivals.add(now, count) for now, count in samples][-1]
    assert got == pytest.approx(rate)


async def test_the_publisher_writes_one_record_per_model_and_withdraws_them() -> None:
    clock = FakeClock(start=100.0)
    store = MemoryStateStore(clock)
    arrivals: collections.Counter[str] = collections.Counter()
    queued = {"chat": 3}
    publisher = ObservationPublisher(
        store=store, gateway_id="gw-1", clock=clock, model_names=lambda: ["chat", "tiny"], arrivals=arrivals,
        queued=lambda model: queued.get(model, 0), in_flight=lambda: {"chat": 5.0},
        ttft_p99_s=lambda: {"chat": 0.25}, window_s=10.0)
    await publisher.publish_once()
    arrivals["chat"] += 40  # 40 arrivals over the next 10 s
    await clock.advance(10.0)
    await publisher.publish_once()
    records = {r.id: r.data for r in await store.list_records(OBSERVATIONS_COLLECTION)}
    assert set(records) == {"chat@gw-1", "tiny@gw-1"}
    chat = records["chat@gw-1"]
    # The gauge's 5 include the 3 still waiting at the gateway: 2 are at replicas.
    assert (chat["queued"], chat["in_flight"], chat["arrivals_per_s"], chat["ttft_p99_s"]) == (3, 2, 4.0, 0.25)
    assert chat["updated_at"] == clock.wall() and chat["gateway_id"] == "gw-1"
    assert records["tiny@gw-1"]["arrivals_per_s"] == 0.0 and records["tiny@gw-1"]["ttft_p99_s"] is None
    await publisher.withdraw()
    assert await store.list_records(OBSERVATIONS_COLLECTION) == []


def test_arrival_spread_is_the_variance_of_each_interval_count_per_second() -> None:
    spread = ArrivalSpread(window_s=10.0)
    # Cumulative counts 0, 2, 2, 6, 8 at 1 s apart: intervals of 2, 0, 4, 2 -> mean 2, variance 2 -> 2.0/s.
    got = [spread.add(float(t), count) for t, count in enumerate([0, 2, 2, 6, 8])]
    assert got[:2] == [None, None] and got[-1] == pytest.approx(2.0)
    # Intervals of 2 s: the same counts are half the variance per second.
    spread = ArrivalSpread(window_s=20.0)
    assert [spread.add(2.0 * t, count) for t, count in enumerate([0, 2, 2, 6, 8])][-1] == pytest.approx(1.0)


async def test_the_publisher_reports_the_prompt_work_the_proxy_counted() -> None:
    clock = FakeClock(start=100.0)
    store = MemoryStateStore(clock)
    work = PromptWork()
    arrivals: collections.Counter[str] = collections.Counter()
    publisher = ObservationPublisher(store=store, gateway_id="gw-1", clock=clock, model_names=lambda: ["chat"],
                                     arrivals=arrivals, queued=lambda model: 0, in_flight=dict, ttft_p99_s=dict,
                                     prompt_work=work, window_s=10.0)
    await publisher.publish_once()
    for tokens in (1000, 3000):  # two requests over the next 10 s
        work.note("chat", tokens)
        arrivals["chat"] += 1
    await clock.advance(10.0)
    await publisher.publish_once()
    chat = (await store.list_records(OBSERVATIONS_COLLECTION))[0].data
    assert (chat["prompt_tokens_per_s"], chat["prompt_tokens_sq_per_s"]) == (400.0, 1e6)
    assert chat["arrivals_var"] is None  # one interval so far: no variance yet
    assert chat["completions_per_s"] is None  # this publisher was given no count of finished requests


async def test_the_publisher_reports_the_requests_that_finished() -> None:
    clock = FakeClock(start=100.0)
    store = MemoryStateStore(clock)
    finished: collections.Counter[str] = collections.Counter()
    publisher = ObservationPublisher(store=store, gateway_id="gw-1", clock=clock, model_names=lambda: ["chat"],
                                     arrivals=collections.Counter(), queued=lambda model: 0, in_flight=dict,
                                     ttft_p99_s=dict, finished=finished, window_s=10.0)
    await publisher.publish_once()
    finished["chat"] += 25  # 25 requests ended over the next 10 s
    await clock.advance(10.0)
    await publisher.publish_once()
    chat = (await store.list_records(OBSERVATIONS_COLLECTION))[0].data
    assert chat["completions_per_s"] == 2.5
