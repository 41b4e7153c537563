"""The typed records that cross the state store, across a rolling upgrade: each round-trips through its JSON,
reads a record of an older release (fields missing) with defaults, ignores the fields a newer release added,
and refuses a newer major with `NewerSchema`, which a polling reader logs once."""

from __future__ import annotations

import json
import logging

import pytest
import redis.asyncio as aioredis

from kvgate.clock import FakeClock
from kvgate.state import (
    AutoscalerStatus,
    MemberRecord,
    MemoryStateStore,
    NewerSchema,
    ObservationRecord,
    ReplicaState,
    SkippedRecords,
)
from kvgate.state.records import MALFORMED, STATUS_COLLECTION, STATUS_ID, ModelStatus, NodeStatus, StatusEvent, read_status
from tests.state.conftest import MakeRedisStore

WALL = 1_700_000_100.0

OBSERVATION = ObservationRecord(model="chat", gateway_id="gw-1", updated_at=WALL, queued=3, in_flight=2,
                                arrivals_per_s=4.0, ttft_p99_s=0.25, arrivals_var=5.5, prompt_tokens_per_s=4000.0,
                                prompt_tokens_sq_per_s=6e6, completions_per_s=3.5)
STATUS = AutoscalerStatus(
    updated_at=WALL, holder="autoscaler-1",
    models={"chat": ModelStatus(desired=3, ready=2, starting=1, panic=True, forecast_rps=3.5, arrivals_per_s=2.25,
                                queued=6, reason="queue 6 / target 2")},
    events=(StatusEvent(WALL - 5, "chat", "scale_up", "2 -> 3: panic"), StatusEvent(WALL - 40, None, "node_create", "n1")),
    nodes=(NodeStatus("n1", "local", "cpu", "on_demand", 0.5, "ready", WALL - 40, ("r1", "r2")),),
    cost_usd_per_hour=0.5, cost_usd_total=0.0056)
MEMBER = MemberRecord("r1", "chat", "http://10.0.0.1:8000", "10.0.0.1:9000", ReplicaState.READY, "n1", "local", WALL)


@pytest.mark.parametrize("record", [OBSERVATION, STATUS, MEMBER], ids=["observation", "status", "member"])
def test_a_record_round_trips_through_its_json_with_its_schema_version(record) -> None:
    data = json.loads(json.dumps(record.to_json()))  # as the store keeps it
    assert data["schema_version"] == 1
    assert type(record).from_json(data) == record


def test_an_observation_of_an_older_release_reads_with_defaults() -> None:
    # No schema_version (written before versions were) and only the fields every release wrote.
    old = ObservationRecord.from_json({"model": "chat", "updated_at": WALL})
    assert old == ObservationRecord(model="chat", gateway_id="", updated_at=WALL, queued=0, in_flight=0,
                                    arrivals_per_s=0.0, ttft_p99_s=None)


def test_a_status_of_an_older_release_reads_with_defaults() -> None:
    old = AutoscalerStatus.from_json({"updated_at": WALL, "models": {"chat": {"desired": 2, "ready": 1, "starting": 1}}})
    assert old.models["chat"] == ModelStatus(desired=2, ready=1, starting=1, panic=False, forecast_rps=None,
                                             arrivals_per_s=0.0, queued=0, reason="")
    assert (old.holder, old.events, old.nodes, old.cost_usd_total) == ("", (), (), 0.0)


@pytest.mark.parametrize("record", [OBSERVATION, STATUS, MEMBER], ids=["observation", "status", "member"])
def test_fields_a_newer_minor_release_added_are_ignored(record) -> None:
    newer = {**record.to_json(), "kv_hit_rate": 0.7, "zone": {"name": "us-east-1a"}}
    assert type(record).from_json(newer) == record


def test_an_event_kind_a_newer_release_added_is_kept() -> None:
    data = STATUS.to_json()
    data["events"].append({"t": WALL, "model": "chat", "kind": "replica_hibernated", "message": "", "extra": 1})
    assert AutoscalerStatus.from_json(data).events[-1].kind == "replica_hibernated"


@pytest.mark.parametrize("record", [OBSERVATION, STATUS, MEMBER], ids=["observation", "status", "member"])
def test_a_newer_major_is_refused_with_newer_schema(record) -> None:
    with pytest.raises(NewerSchema, match="schema_version 2, newer than the 1 this release reads"):
        type(record).from_json({**record.to_json(), "schema_version": 2})


def test_a_count_of_infinity_is_malformed_not_an_error_that_escapes() -> None:
    # JSON's 1e999 reads back as inf and int() of it raises OverflowError: readers catch MALFORMED, so it
    # must be one (the dashboard's sampler and the autoscaler's resume would otherwise die on it).
    raw = json.loads('{"desired": 1e999, "ready": 0, "starting": 0}')
    with pytest.raises(MALFORMED):
        ModelStatus.from_json(raw)


@pytest.mark.parametrize("version", [0, "1", True, None])
def test_a_schema_version_that_is_not_a_positive_int_is_malformed(version) -> None:
    with pytest.raises(ValueError, match="schema_version must be an int >= 1"):
        ObservationRecord.from_json({**OBSERVATION.to_json(), "schema_version": version})


def test_a_skipped_newer_record_is_logged_once_per_record_and_version(caplog: pytest.LogCaptureFixture) -> None:
    skipped = SkippedRecords(logging.getLogger("test.skipped"))
    v2, v3 = NewerSchema("observation", 2, 1), NewerSchema("observation", 3, 1)
    with caplog.at_level(logging.WARNING, logger="test.skipped"):
        for _ in range(3):  # three polls
            skipped.newer("observations", "chat@gw-2", v2)
        skipped.newer("observations", "tiny@gw-2", v2)
        skipped.newer("observations", "chat@gw-2", v3)
    assert [r.getMessage() for r in caplog.records] == [
        "skipping state store record observations/chat@gw-2: observation record has schema_version 2, newer than "
        "the 1 this release reads: written by a newer kvgate; skipped until this process is upgraded",
        "skipping state store record observations/tiny@gw-2: observation record has schema_version 2, newer than "
        "the 1 this release reads: written by a newer kvgate; skipped until this process is upgraded",
        "skipping state store record observations/chat@gw-2: observation record has schema_version 3, newer than "
        "the 1 this release reads: written by a newer kvgate; skipped until this process is upgraded",
    ]


async def test_read_status_skips_a_newer_status_record_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStateStore(FakeClock())
    skipped = SkippedRecords(logging.getLogger("test.status"))
    assert await read_status(store, skipped) is None  # no record yet
    await store.put_record(STATUS_COLLECTION, STATUS_ID, STATUS.to_json())
    assert await read_status(store, skipped) == STATUS
    await store.put_record(STATUS_COLLECTION, STATUS_ID, {**STATUS.to_json(), "schema_version": 2})
    with caplog.at_level(logging.WARNING, logger="test.status"):
        assert await read_status(store, skipped) is None
        assert await read_status(store, skipped) is None
    assert len(caplog.records) == 1 and "autoscaler/status" in caplog.records[0].getMessage()


async def test_redis_membership_skips_a_replica_of_a_newer_release(
    make_redis_store: MakeRedisStore, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_redis_store()
    await store.put_member(MEMBER, ttl_s=30.0)
    newer = {**MEMBER.to_json(), "replica_id": "r2", "schema_version": 2, "state": "hibernating"}
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:  # as a newer release's store writes it: "<expires_at>\n<json>"
        await client.hset(f"{prefix}members", "r2", f"{WALL + 1e6!r}\n{json.dumps(newer)}")
    finally:
        await client.aclose()
    with caplog.at_level(logging.WARNING, logger="kvgate.state.redis_store"):
        assert [m.replica_id for m in await store.list_members()] == ["r1"]
        assert [m.replica_id for m in await store.list_members()] == ["r1"]
    assert len(caplog.records) == 1 and "members/r2" in caplog.records[0].getMessage()
