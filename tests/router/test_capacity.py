"""What a model's replicas run at once (`router.capacity`), from the registry or learned from their reports."""

from __future__ import annotations

import math

import pytest

from kvgate.registry.tenant import TenantSpec
from kvgate.router.capacity import RunCeiling, model_capacity
from kvgate.router.load_readers import LoadReport


def test_a_replica_that_never_queued_has_no_known_capacity() -> None:
    ceiling = RunCeiling().seen(LoadReport(num_running=12))
    assert ceiling.most_running == 12 and ceiling.capacity() == math.inf


def test_once_it_queues_its_capacity_is_the_most_it_ran_plus_one() -> None:
    ceiling = RunCeiling().seen(LoadReport(num_running=12)).seen(LoadReport(num_running=8, num_waiting=3))
    assert ceiling.capacity() == 13
    assert ceiling.seen(LoadReport(num_running=16)).capacity() == 17  # it showed a larger batch


def test_a_model_capacity_is_the_sum_or_unknown_while_any_replica_is() -> None:
    known = RunCeiling(8, True)
    assert model_capacity([known, known], None) == 18
    assert model_capacity([known, RunCeiling(8, False)], None) == math.inf
    assert model_capacity([], None) == math.inf
    assert model_capacity([RunCeiling(), RunCeiling()], 4) == 8  # the registry's figure wins


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
