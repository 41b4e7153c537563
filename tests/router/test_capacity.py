"""What a model's replicas run at once (`router.capacity`), from the registry or learned from their reports."""

from __future__ import annotations

import math

import pytest

from kvgate.registry.tenant import TenantSpec
from kvgate.router.capacity import RunCeiling, model_capacity, model_probes
from kvgate.router.load_readers import LoadReport


def test_a_replica_that_never_queued_has_no_known_capacity() -> None:
    ceiling = RunCeiling().seen(LoadReport(num_running=12), 0.0)
    assert ceiling.most_running == 12 and ceiling.capacity() == math.inf


def queued(ceiling: RunCeiling, running: int, at: float) -> RunCeiling:
    """Two reports 1 s apart with requests waiting: a queue."""
    return ceiling.seen(LoadReport(num_running=running, num_waiting=2), at).seen(
        LoadReport(num_running=running, num_waiting=1), at + 1.0)


def test_requests_waiting_in_one_report_only_are_a_steps_arrivals_not_a_queue() -> None:
    ceiling = RunCeiling().seen(LoadReport(num_running=7, num_waiting=1), 0.0).seen(LoadReport(num_running=8), 1.0)
    assert not ceiling.has_queued and ceiling.capacity() == math.inf
    # nor are two reports with a report without requests waiting between them
    ceiling = ceiling.seen(LoadReport(num_running=8, num_waiting=1), 2.0).seen(LoadReport(num_running=8), 3.0)
    assert ceiling.seen(LoadReport(num_running=8, num_waiting=1), 4.0).capacity() == math.inf


def test_queued_below_its_most_it_is_offered_one_more() -> None:
    # waiting while running 8 of the 12 it once ran (a short KV cache, say): 12 is not shown to be its batch
    ceiling = queued(RunCeiling().seen(LoadReport(num_running=12), 0.0), 8, 1.0)
    assert ceiling.capacity() == 13
    assert ceiling.seen(LoadReport(num_running=16), 3.0).capacity() == 17  # it showed a larger batch


def test_queued_at_its_most_its_batch_is_shown_and_held_but_probed_every_30_s() -> None:
    ceiling = queued(RunCeiling(), 12, -1.0)
    assert ceiling.capacity() == 12  # 12 run, more wait: its batch is 12, and nobody waits inside it
    held = ceiling.seen(LoadReport(num_running=12), 29.0)
    assert held.capacity() == 12
    probe = held.seen(LoadReport(num_running=12), 30.0)  # 30 s since it showed its batch: offered one more
    assert probe.capacity() == 13 and probe.probe() == 1 and held.probe() == 0
    assert queued(probe, 12, 31.0).capacity() == 12  # the same batch
    grown = probe.seen(LoadReport(num_running=13), 31.0)  # it ran the one more: probe on until it queues
    assert grown.capacity() == 14
    assert queued(grown, 13, 32.0).capacity() == 13


def test_a_model_capacity_is_the_sum_or_unknown_while_any_replica_is() -> None:
    known = RunCeiling(8, True)
    assert model_capacity([known, known], None) == 18
    assert model_capacity([known, RunCeiling(8, False)], None) == math.inf
    assert model_capacity([], None) == math.inf
    assert model_capacity([RunCeiling(), RunCeiling()], 4) == 8  # the registry's figure wins


def test_a_model_counts_its_probe_places() -> None:
    held, probing = RunCeiling(8, True, full_at=0.0, probing=False), RunCeiling(8, True)
    assert model_capacity([held, probing], None) == 17 and model_probes([held, probing], None) == 1
    assert model_probes([RunCeiling(), probing], 4) == 0  # a configured batch is never probed
    assert RunCeiling().probe() == 0  # nothing shown yet: no place is a probe (the capacity is unknown)


@pytest.mark.parametrize("asked, given", [(None, 0), (3, 3), (-5, -5)])
def test_a_tenant_may_ask_for_up_to_its_max_priority_and_any_lower(asked: int | None, given: int) -> None:
    spec = TenantSpec(api_key_hmac="ab" * 32, models=("*",), priority=0, max_priority=3)
    assert spec.priority_of(asked) == given


def test_a_priority_above_the_tenants_max_is_refused() -> None:
    spec = TenantSpec(api_key_hmac="ab" * 32, models=("*",), priority=1)
    with pytest.raises(ValueError, match="above the highest this key may ask for"):
        spec.priority_of(2)


def test_a_max_priority_below_the_tenants_own_is_a_registry_error() -> None:
    with pytest.raises(ValueError, match="below the tenant's own priority"):
        TenantSpec(api_key_hmac="ab" * 32, models=("*",), priority=2, max_priority=1)
