"""Reading the gateways' observation records: summed across gateways, stale and malformed ones
skipped, and those of a newer release's major skipped and said once. Table-driven over `totals_by_model` (pure) plus one read through a real memory store."""

from __future__ import annotations

import logging
from types import MappingProxyType

import pytest

from kvgate.autoscaler.observe import GatewayTotals, read_gateway_totals, totals_by_model
from kvgate.clock import FakeClock
from kvgate.state import MemoryStateStore, SkippedRecords, StoredRecord

NOW = 1_700_000_100.0


def rec(model: str, gateway: str, age_s: float = 1.0, **fields) -> StoredRecord:
    data = {"model": model, "gateway_id": gateway, "queued": 0, "in_flight": 0, "arrivals_per_s": 0.0,
            "ttft_p99_s": None, "updated_at": NOW - age_s, **fields}
    return StoredRecord("observations", f"{model}@{gateway}", 1, MappingProxyType(data))


@pytest.mark.parametrize("records,expected", [
    # two fresh gateways: counts add, rates add, p99 is the worst gateway's (p99s do not add)
    ([rec("m", "g1", queued=2, in_flight=5, arrivals_per_s=3.0, ttft_p99_s=0.4),
      rec("m", "g2", queued=1, in_flight=4, arrivals_per_s=1.5, ttft_p99_s=0.9)],
     {"m": GatewayTotals("m", 3, 9, 4.5, 0.9, 2)}),
    # a gateway silent for 10 s or more is gone: its last load no longer counts
    ([rec("m", "g1", in_flight=5), rec("m", "g2", age_s=10.0, in_flight=50)],
     {"m": GatewayTotals("m", 0, 5, 0.0, None, 1)}),
    # 9.9 s old still counts
    ([rec("m", "g1", age_s=9.9, queued=1)], {"m": GatewayTotals("m", 1, 0, 0.0, None, 1)}),
    # models are kept apart
    ([rec("a", "g1", queued=1), rec("b", "g1", queued=2)],
     {"a": GatewayTotals("a", 1, 0, 0.0, None, 1), "b": GatewayTotals("b", 2, 0, 0.0, None, 1)}),
    # prompt work and arrival variances add across gateways; one that says no variance adds none
    ([rec("m", "g1", arrivals_per_s=2.0, prompt_tokens_per_s=2000.0, prompt_tokens_sq_per_s=4e6, arrivals_var=2.5),
      rec("m", "g2", arrivals_per_s=1.0, prompt_tokens_per_s=500.0, prompt_tokens_sq_per_s=3e5),
      rec("m", "g3", arrivals_per_s=1.0, arrivals_var=1.0)],
     {"m": GatewayTotals("m", 0, 0, 4.0, None, 3, prompt_tokens_per_s=2500.0, prompt_tokens_sq_per_s=4.3e6,
                         arrivals_var=3.5)}),
    # completions add only when every gateway counts them (they pair with in_flight, which every gateway reports)
    ([rec("m", "g1", in_flight=10, completions_per_s=2.0), rec("m", "g2", in_flight=5, completions_per_s=1.0)],
     {"m": GatewayTotals("m", 0, 15, 0.0, None, 2, completions_per_s=3.0)}),
    ([rec("m", "g1", in_flight=10, completions_per_s=2.0), rec("m", "g2", in_flight=5)],
     {"m": GatewayTotals("m", 0, 15, 0.0, None, 2)}),
    # a record from slightly in the future (another host's clock runs ahead) counts
    ([rec("m", "g1", age_s=-2.0, in_flight=1)], {"m": GatewayTotals("m", 0, 1, 0.0, None, 1)}),
])
def test_totals_are_summed_over_fresh_gateways(records, expected) -> None:
    assert dict(totals_by_model(records, NOW).totals) == expected


def test_malformed_and_stale_records_are_counted_not_raised() -> None:
    read = totals_by_model([rec("m", "g1", queued=-1), rec("m", "g2", in_flight="many"), rec("", "g3"),
                            rec("m", "g4", age_s=30), rec("m", "g5", queued=2)], NOW)
    assert (read.num_malformed, read.num_stale) == (3, 1)
    assert read.totals["m"].queued == 2


async def test_read_through_the_store_uses_the_given_wall_time() -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    await store.put_record("observations", "m@g1", {"model": "m", "gateway_id": "g1", "queued": 4, "in_flight": 1,
                                                    "arrivals_per_s": 2.0, "ttft_p99_s": 0.2,
                                                    "updated_at": clock.wall()})
    assert (await read_gateway_totals(store, clock.wall() + 5)).totals["m"].queued == 4
    assert (await read_gateway_totals(store, clock.wall() + 10)).totals == {}


def test_a_gateway_of_a_newer_release_adds_fields_and_still_counts() -> None:
    read = totals_by_model([rec("m", "g1", queued=2, kv_hit_rate=0.7, schema_version=1)], NOW)
    assert read.totals["m"].queued == 2 and read.num_malformed == 0


def test_a_record_of_a_newer_major_is_skipped_and_returned_for_the_shell_to_log() -> None:
    read = totals_by_model([rec("m", "g1", queued=2), rec("m", "g2", queued=5, schema_version=2)], NOW)
    assert read.totals["m"].queued == 2 and read.num_malformed == 0
    assert list(read.newer) == ["m@g2"] and read.newer["m@g2"].found == 2


async def test_a_newer_major_observation_is_logged_once_across_reads(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    await store.put_record("observations", "m@g2", {"model": "m", "gateway_id": "g2", "queued": 5,
                                                    "updated_at": clock.wall(), "schema_version": 2})
    skipped = SkippedRecords(logging.getLogger("test.observe"))
    with caplog.at_level(logging.WARNING, logger="test.observe"):
        for _ in range(3):  # three ticks
            assert (await read_gateway_totals(store, clock.wall(), skipped=skipped)).totals == {}
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["skipping state store record observations/m@g2"]
