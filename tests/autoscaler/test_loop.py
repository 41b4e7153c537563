"""The live loop on a fake clock: observations in the state store -> decisions -> the providers fake ->
membership records and the status record. One tick per simulated second, driven by `tick()`.

Registry (tests/autoscaler/fleet_helpers.py): model `m` needs one L4, target 4 ongoing per replica,
0..4 replicas, stable window 20 s, scale-to-zero grace 30 s, no scale-down delay; pool `gpu` sells g6.xlarge at $0.80/h
on demand. The fake provider's replicas become ready `replica_start_latency_s` after they start.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.autoscaler.claims import LEDGER_ID
from kvgate.autoscaler.status import STATUS_COLLECTION, STATUS_ID
from kvgate.clock import FakeClock
from kvgate.state import MemoryStateStore
from tests.autoscaler.fleet_helpers import load_test_registry, make_autoscaler, members, observe
from kvgate.providers.base import Node, NodeClaim, Offering, ProviderError, ReplicaState
from kvgate.providers.fake import FakeProvider


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> MemoryStateStore:
    return MemoryStateStore(clock)


@pytest.fixture
def snapshot(tmp_path: Path):
    return load_test_registry(tmp_path)


@pytest.fixture
def provider(snapshot, clock: FakeClock) -> FakeProvider:
    return FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, replica_start_latency_s=3)


def calls(provider: FakeProvider, method: str) -> list[tuple]:
    return [args for name, args in provider.calls if name == method]


async def run_ticks(autoscaler, clock: FakeClock, seconds: int, before_tick=None) -> list:
    reports = []
    for _ in range(seconds):
        if before_tick is not None:
            await before_tick()
        reports.append(await autoscaler.tick())
        await clock.advance(1)
    return reports


async def test_a_waiting_request_brings_a_model_from_zero_to_a_ready_member(snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    seen: list[list[tuple[str, str]]] = []

    async def gateway_holds_three() -> None:
        await observe(store, clock, queued=3)  # 3 requests held at the gateway: ceil(3 / 4) = 1 replica
        seen.append(await members(store))

    reports = await run_ticks(autoscaler, clock, 6, gateway_holds_three)

    assert reports[0].decisions["m"].desired == 1 and reports[0].error is None
    [node] = await provider.list()
    [replica] = await provider.list_replicas()
    # tick 0 buys the node, tick 1 starts the replica (STARTING), 3 s later it is READY
    assert [s for s in seen if s] == [[(replica.id, "starting")]] * 3 + [[(replica.id, "ready")]]
    [member] = await store.list_members()
    assert (member.node_id, member.pool, member.url) == (node.id, "gpu", replica.url)
    status = (await store.get_record(STATUS_COLLECTION, STATUS_ID)).data
    assert dict(status["models"]["m"]) | {"reason": ""} == {
        "desired": 1, "ready": 1, "starting": 0, "panic": False, "forecast_rps": None,
        "arrivals_per_s": 0.0, "queued": 3, "reason": ""}
    assert [(n["id"], n["price_usd_per_hour"], tuple(n["replicas"])) for n in status["nodes"]] == [
        (node.id, 0.80, (replica.id,))]
    assert status["cost_usd_per_hour"] == 0.80 and status["holder"] == "a"
    kinds = [e["kind"] for e in status["events"]]
    assert kinds[:4] == ["lease_acquired", "scale_up", "node_create", "replica_start"]


@pytest.mark.parametrize("work", [False, True])
async def test_a_model_with_an_slo_and_figures_is_sized_on_its_prompt_work(tmp_path: Path, store, clock,
                                                                         work: bool) -> None:
    """The gateways report 4 requests/s of 1,000-token prompts with 2 in flight: on concurrency that is one
    replica (2 / 4). With a 2 s SLO and 4,000 prompt tokens/s an L4, each prefill takes 0.25 s: one replica's
    whole prefill, which one replica cannot keep up with and two keep within the SLO for all but 0.2%: the loop
    reads the prompt work from the records and asks for 2 (`autoscaler.work`)."""
    snapshot = load_test_registry(tmp_path, min_replicas=1, work=work)
    provider = FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, replica_start_latency_s=3)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)

    async def gateway_reports() -> None:
        await observe(store, clock, in_flight=2, arrivals_per_s=4.0, prompt_tokens_per_s=4000.0,
                      prompt_tokens_sq_per_s=4000.0 * 1000.0 * 2.0, arrivals_var=4.0)

    reports = await run_ticks(autoscaler, clock, 12, gateway_reports)
    decision = reports[-1].decisions["m"]
    if work:
        assert decision.desired == decision.work_desired == 2 and "prefill 1000 tokens" in decision.reason
    else:
        assert decision.desired == 1 and decision.work_desired == 0


async def test_an_idle_model_is_drained_before_it_is_stopped_then_its_node_released(
        snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [replica] = await provider.list_replicas()
    history: list[tuple[list, int]] = []

    async def idle() -> None:
        await observe(store, clock)  # nothing queued, running or arriving
        history.append((await members(store), len(calls(provider, "stop_replica"))))

    await run_ticks(autoscaler, clock, 60, idle)

    draining_at = next(i for i, (m, _) in enumerate(history) if m == [(replica.id, "draining")])
    stopped_at = next(i for i, (_, stops) in enumerate(history) if stops)
    # grace 30 s of idleness, then DRAINING for drain_notice_s (2 s) before the replica is told to stop
    assert 28 <= draining_at and stopped_at - draining_at >= 2
    assert all(stops == 0 for _, stops in history[:draining_at + 1])
    assert calls(provider, "stop_replica") == [(replica.id, 30.0)]
    assert await store.list_members() == []
    assert await provider.list() == []  # the empty node was released after the planner's 5 s grace
    status = (await store.get_record(STATUS_COLLECTION, STATUS_ID)).data
    assert status["models"]["m"]["desired"] == 0 and status["nodes"] == ()


async def test_a_replica_that_keeps_failing_is_retried_with_exponential_backoff(
        snapshot, store, clock, provider) -> None:
    provider.fail_next_replicas(4, reason="engine exited: CUDA out of memory")
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    start_times: list[float] = []

    async def demand() -> None:
        await observe(store, clock, queued=1)
        start_times.extend([clock.now()] * (len(calls(provider, "start_replica")) - len(start_times)))

    await run_ticks(autoscaler, clock, 120, demand)

    gaps = [b - a for a, b in zip(start_times, start_times[1:])]
    # start latency 3 s, then back-off 5, 10, 20, 40 s: each gap = 3 s to fail + the back-off (+1 tick)
    assert len(start_times) == 5, start_times
    assert [round(g) for g in gaps] == [8, 13, 23, 43]
    status = (await store.get_record(STATUS_COLLECTION, STATUS_ID)).data
    failures = [e["message"] for e in status["events"] if e["kind"] == "replica_failed"]
    assert len(failures) == 4 and all("CUDA out of memory" in m for m in failures)
    assert status["models"]["m"]["ready"] == 1  # the fifth start worked


class RefusedBootNodes(FakeProvider):
    """A pool whose nodes boot into their replica (Offering.replica_at_boot, as AWS) and whose every launch is
    refused for good, as EC2 refuses user data over its size limit."""

    async def offerings(self) -> list[Offering]:
        return [replace(o, replica_at_boot=True) for o in await super().offerings()]

    async def create(self, claim: NodeClaim) -> Node:
        self.calls.append(("create", (claim.id,)))
        raise ProviderError("user data is 17,095 bytes; EC2 takes at most 16,384", retryable=False)


async def test_a_boot_node_refused_for_good_is_retried_with_the_models_backoff(snapshot, store, clock) -> None:
    # Buying such a node is starting a replica: a refusal backs the model off (5, 10, 20 s ...) instead of
    # buying again every tick.
    provider = RefusedBootNodes("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    bought_at: list[float] = []

    async def demand() -> None:
        await observe(store, clock, queued=1)
        bought_at.extend([clock.now()] * (len(calls(provider, "create")) - len(bought_at)))

    await run_ticks(autoscaler, clock, 40, demand)
    assert [round(b - a) for a, b in zip(bought_at, bought_at[1:])] == [5, 10, 20]


async def test_a_preempted_spot_node_is_replaced_on_demand_without_backoff(tmp_path: Path, store, clock) -> None:
    snapshot = load_test_registry(tmp_path, allow_spot=True)
    provider = FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, replica_start_latency_s=3)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [node] = await provider.list()
    assert node.capacity_type.value == "spot"  # $0.35/h beats $0.80/h
    provider.preempt(node.id)

    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))

    [replacement] = await provider.list()
    # the interrupted spot offering is skipped for 180 s, so the replacement is on demand
    assert replacement.id != node.id and replacement.capacity_type.value == "on_demand"
    assert [r.state.value for r in await provider.list_replicas()] == ["ready"]
    status = (await store.get_record(STATUS_COLLECTION, STATUS_ID)).data
    assert not [e for e in status["events"] if e["kind"] == "replica_failed"]
    [preempted] = [e for e in status["events"] if e["kind"] == "preempted"]
    assert node.id in preempted["message"] and "spot interruption" in preempted["message"]


async def member_states(store, clock: FakeClock, replica_id: str, seen: list) -> None:
    """One tick's look, as a gateway polls: the replica's membership state, None once it has no record."""
    await observe(store, clock, in_flight=2)
    seen.append(dict(await members(store)).get(replica_id))


def assert_retired(seen: list, member_ttl_s: int = 10) -> None:
    """READY, then DRAINING (gateways stop sending to it at their next poll) until the record lapses, then
    gone; never READY again, and never a READY record that merely vanished, which gateways would keep in
    rotation while its health checks pass (router.membership, `judge_unlisted`)."""
    assert seen[0] == "ready"
    draining = [i for i, state in enumerate(seen) if state == "draining"]
    assert draining and draining == list(range(1, draining[-1] + 1)), seen
    assert member_ttl_s - 1 <= len(draining) <= member_ttl_s, seen
    assert set(seen[draining[-1] + 1:]) == {None}, seen


async def test_a_preempted_replica_is_published_draining_until_its_record_lapses(tmp_path: Path, store, clock) -> None:
    snapshot = load_test_registry(tmp_path, allow_spot=True)
    provider = FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock, replica_start_latency_s=3)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [node], [replica] = await provider.list(), await provider.list_replicas()
    provider.preempt(node.id)
    seen: list = []

    await run_ticks(autoscaler, clock, 16, lambda: member_states(store, clock, replica.id, seen))

    assert_retired(seen)


async def test_a_ready_replica_the_provider_stops_listing_is_published_draining(snapshot, store, clock,
                                                                                provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [replica] = await provider.list_replicas()
    del provider.cloud.replicas[replica.id]  # gone behind the autoscaler's back: a reclaimed VM, a deleted pod
    seen: list = []

    await run_ticks(autoscaler, clock, 16, lambda: member_states(store, clock, replica.id, seen))

    assert_retired(seen)


async def test_a_replica_that_fails_while_serving_is_published_draining_until_its_record_lapses(
        snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [replica] = await provider.list_replicas()
    record = provider.cloud.replicas[replica.id]
    record.handle = replace(record.handle, state=ReplicaState.FAILED, reason="engine exited: CUDA error")
    seen: list = []

    await run_ticks(autoscaler, clock, 16, lambda: member_states(store, clock, replica.id, seen))

    assert_retired(seen)


@pytest.mark.parametrize("method, ticks", [("list_replicas", 1), ("list", 3)])
async def test_a_pool_that_cannot_be_listed_keeps_its_replicas_in_rotation(
        snapshot, store, clock, provider, method: str, ticks: int) -> None:
    """A failed listing says nothing about the replicas: their records are neither retired nor
    removed, and nothing is planned on the partial view (a second replica would be a double buy)."""
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [replica] = await provider.list_replicas()
    starts = len(calls(provider, "start_replica"))
    provider.fail_next(ticks, methods=[method])
    seen: list = []

    reports = await run_ticks(autoscaler, clock, ticks + 3, lambda: member_states(store, clock, replica.id, seen))

    assert seen == ["ready"] * (ticks + 3)
    assert len(calls(provider, "start_replica")) == starts and len(await provider.list_replicas()) == 1
    status = (await store.get_record(STATUS_COLLECTION, STATUS_ID)).data
    assert any(f"{method} failed" in e["message"] for e in status["events"]) and reports[0].error is None


async def test_a_new_leader_retires_a_ready_record_left_for_a_replica_that_is_gone(
        snapshot, store, clock, provider) -> None:
    first = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(first, clock, 6, lambda: observe(store, clock, in_flight=2))
    [replica] = await provider.list_replicas()
    await first.stop()  # hands the lease over at once; its READY record is still out
    del provider.cloud.replicas[replica.id]  # gone before the next leader lists it
    second = make_autoscaler(snapshot, store, clock, provider, holder="b")
    seen: list = []

    await run_ticks(second, clock, 16, lambda: member_states(store, clock, replica.id, seen))

    assert_retired(seen)


async def test_the_running_cost_accrues_per_tick(snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 91, lambda: observe(store, clock, in_flight=2))
    status = (await store.get_record(STATUS_COLLECTION, STATUS_ID)).data
    # bought at tick 0 and listed from tick 1: 89 s between the first tick that saw it and tick 90,
    # at $0.80/h -> $0.80 x 89 / 3600 = $0.019778
    assert status["cost_usd_total"] == pytest.approx(0.80 * 89 / 3600)


async def test_start_and_stop_run_ticks_on_the_clock_and_release_the_lease(snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await observe(store, clock, queued=1)
    await autoscaler.start()
    await clock.advance(5)
    assert await store.lease_holder("autoscaler") == "a" and len(await provider.list()) == 1

    await autoscaler.stop()

    assert await store.lease_holder("autoscaler") is None
    assert len(await provider.list()) == 1 and len(await provider.list_replicas()) == 1  # left running
    assert clock.num_sleepers == 0


class SlowStopProvider(FakeProvider):
    """A provider whose stop_replica takes 20 s of (fake) time, as a draining engine does."""

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None:
        await self._clock.sleep(20)
        await super().stop_replica(replica_id, drain_deadline_s)


async def test_a_slow_drain_does_not_stall_the_loop(snapshot, store, clock) -> None:
    provider = SlowStopProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock,
                                replica_start_latency_s=3)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 6, lambda: observe(store, clock, in_flight=2))
    [replica] = await provider.list_replicas()
    states: list[list] = []

    async def idle() -> None:
        await observe(store, clock)
        states.append(await members(store))

    # each tick returns although a stop takes 20 s: a tick awaiting it would never return here
    reports = await run_ticks(autoscaler, clock, 70, idle)

    assert len(reports) == 70 and all(r.leader and r.error is None for r in reports)
    draining = [i for i, m in enumerate(states) if m == [(replica.id, "draining")]]
    assert len(draining) >= 20  # DRAINING for the notice plus the whole 20 s stop
    assert states[-1] == [] and await provider.list_replicas() == []


async def test_release_fleet_stops_every_replica_and_deletes_every_node(snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 8, lambda: observe(store, clock, queued=9))  # 3 replicas, 3 nodes
    assert len(await provider.list_replicas()) == 3
    await autoscaler.stop()

    events = await autoscaler.release_fleet()

    assert await provider.list() == [] and await provider.list_replicas() == []
    assert await store.list_members() == []
    assert [r.id for r in await store.list_records("claims")] == [LEDGER_ID]  # no claim left; the ledger stays
    assert [e.kind.value for e in events] == ["node_delete"] * 3
    assert len(calls(provider, "stop_replica")) == 3


async def test_release_fleet_publishes_each_replica_draining_while_it_stops(snapshot, store, clock) -> None:
    provider = SlowStopProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock,
                                replica_start_latency_s=3)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    await run_ticks(autoscaler, clock, 8, lambda: observe(store, clock, queued=9))  # 3 replicas, 3 nodes
    await autoscaler.stop()

    release = asyncio.create_task(autoscaler.release_fleet())
    await clock.advance(5)  # each stop takes 20 s (drains in parallel); a record lives member_ttl_s (10 s)

    assert {state for _, state in await members(store)} == {"draining"} and len(await members(store)) == 3
    await clock.advance(20)
    await release
    assert await store.list_members() == [] and await provider.list_replicas() == []


# -- acting at once: a wake, a replica's readiness ------------------------------------------------


async def settle(condition, turns: int = 200) -> bool:
    """Let the event loop run (no clock time passes) until `condition()` holds; whether it did."""
    for _ in range(turns):
        if await condition():
            return True
        await asyncio.sleep(0)
    return await condition()


async def test_a_wake_ticks_at_once_instead_of_after_the_interval(snapshot, store, clock, provider) -> None:
    autoscaler = make_autoscaler(snapshot, store, clock, provider, interval_s=10, lease_ttl_s=30)
    await autoscaler.start()
    assert await settle(lambda: _leader(store))  # the first tick ran; nothing to do at zero
    await observe(store, clock, queued=1)

    autoscaler.wake()

    async def bought() -> bool:
        return len(await provider.list()) == 1
    started = clock.now()
    assert await settle(bought)  # without the clock moving: not 10 s later
    assert clock.now() == started
    await autoscaler.stop()


async def _leader(store) -> bool:
    return await store.lease_holder("autoscaler") == "a"


async def _false() -> bool:
    return False


class WatchingProvider(FakeProvider):
    """A fake provider that can watch a starting replica, as the local provider does (WatchesReadiness)."""

    async def wait_ready(self, replica_id: str, timeout_s: float, poll_s: float = 0.1):
        deadline = self._clock.now() + timeout_s
        while True:
            [handle] = [r for r in await self.list_replicas() if r.id == replica_id]
            if handle.state is not ReplicaState.STARTING or self._clock.now() >= deadline:
                return handle
            await self._clock.sleep(poll_s)


async def test_a_replica_is_published_ready_when_it_is_not_at_the_next_tick(snapshot, store, clock) -> None:
    provider = WatchingProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock,
                                replica_start_latency_s=3)
    autoscaler = make_autoscaler(snapshot, store, clock, provider, interval_s=10, lease_ttl_s=30)
    await observe(store, clock, queued=1)
    await autoscaler.start()
    started, ready_at = clock.now(), None
    for _ in range(100):  # 10 s in steps of 0.1 s
        await clock.advance(0.1)
        await settle(lambda: _false())
        if ready_at is None and any(state == "ready" for _, state in await members(store)):
            ready_at = clock.now() - started
    await autoscaler.stop()
    # The node runs at once, so a woken tick starts the replica at t=0, not at the tick of t=10; it is ready 3 s
    # later and published within a poll of that, not at the tick of t=10.
    assert ready_at is not None and 3.0 <= ready_at <= 3.5
