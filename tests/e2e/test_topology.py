"""The topology the Helm chart deploys, as real processes under steady load: a redis-server, two `kvgate
autoscaler` (one leads through the Redis lease, one waits), two `kvgate router`, and two `kvgate engine`
replicas (builtin tiny-llama) that the leader starts through the `local` provider. Client loops send chat
completions, streamed and not, through both gateways while, one after another:

1. the leading autoscaler is SIGKILLed (and replaced, as its Deployment would, by a new standby);
2. one gateway is SIGKILLed (and replaced on the same port after 2 s);
3. redis-server is SIGKILLed and an empty one started on the same port 2 s later.

`loadtests/topology.py` runs the scenario (`run_scenario`) and prints its figures; this module runs it once
with short timings (a 0.5 s tick, a 4 s lease; ~25 s on 2 cores) and checks each property in its own test.
"""

from __future__ import annotations

import asyncio

import pytest

from loadtests.topology import GATEWAYS, KILLED_GATEWAY, PHASES, Plan, run_scenario
from loadtests.topology_stack import TopologySpec

pytestmark = pytest.mark.timeout(300)  # one scenario: ~25 s here, a cold engine build and a loaded CI host on top

INTERVAL_S = 0.5  # autoscaler tick
LEASE_TTL_S = 4.0  # autoscaler lease
POLL_S = 1.0  # the gateways' membership poll (their default)
# What a loaded 2-core host may add to any one step: a tick or poll that ran late, a slow store read.
SLACK_S = 2.0
NUM_REPLICAS = 2
# What a client of the killed gateway sees: a request or stream cut in flight, then connections refused until
# its replacement listens.
KILLED_GATEWAY_ERRORS = {"ServerDisconnectedError", "ClientPayloadError", "stream ended without [DONE]",
                         "ClientConnectorError", "ClientOSError"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = TopologySpec(work_dir=tmp_path_factory.mktemp("topology"), num_replicas=NUM_REPLICAS,
                        interval_s=INTERVAL_S, lease_ttl_s=LEASE_TTL_S)
    plan = Plan(clients_per_gateway=2, pause_s=0.05, steady_s=2.0, settle_s=2.0, gateway_down_s=2.0,
                redis_down_s=2.0)
    return asyncio.run(run_scenario(spec, plan))


def phase(scenario: dict, name: str) -> dict:
    return next(row for row in scenario["phases"] if row["phase"] == name)


def test_every_phase_had_both_gateways_under_load(scenario: dict) -> None:
    # ~2 loops x ~10 requests/s per gateway: 2 s phases see ~40 each (~20 with 4 busy loops beside); 5 is not idle.
    for name in PHASES:
        for gateway in GATEWAYS:
            assert phase(scenario, name)["gateways"][gateway]["sent"] >= 5, (name, gateway)


def test_the_standby_takes_the_lease_within_the_lease_time(scenario: dict) -> None:
    # The leader renewed its 4 s lease at its last 0.5 s tick before the kill, so the lease lapses 3.5-4.0 s
    # after the kill and the standby, ticking every 0.5 s, holds it 3.5-4.5 s after. Not before the lease lapsed
    # (a leader's last tick may have run up to SLACK_S late), nor long after it.
    takeover_s = scenario["leader_failover"]["takeover_s"]
    assert LEASE_TTL_S - INTERVAL_S - SLACK_S <= takeover_s <= LEASE_TTL_S + INTERVAL_S + SLACK_S


def test_a_failover_between_autoscalers_fails_no_request_and_restarts_no_replica(scenario: dict) -> None:
    assert all(row["failed"] == 0 for row in phase(scenario, "leader killed")["gateways"].values())
    # The standby adopted the replicas the dead leader started: the same ids, in the same engine processes.
    assert scenario["replicas_after_failover"] == scenario["replicas_at_start"]


def test_killing_a_gateway_fails_only_the_requests_sent_through_it(scenario: dict) -> None:
    row = phase(scenario, "gateway killed")["gateways"]
    survivor = next(g for g in GATEWAYS if g != KILLED_GATEWAY)
    assert row[survivor]["failed"] == 0
    assert row[KILLED_GATEWAY]["failed"] > 0  # its clients saw it go ...
    assert set(row[KILLED_GATEWAY]["reasons"]) <= KILLED_GATEWAY_ERRORS  # ... as a lost connection, nothing else
    # Its replacement reads membership from Redis before it listens: routing to every replica at once.
    assert scenario["gateway_kill"]["replacement_ready_s"] <= 10.0  # ~1 s: a Python start on a busy host


def test_an_empty_redis_fails_no_request_and_membership_is_back_within_seconds(scenario: dict) -> None:
    assert all(row["failed"] == 0 for row in phase(scenario, "redis restarted empty")["gateways"].values())
    redis = scenario["redis_restart"]
    # Once Redis answers, the next tick (<= 0.5 s) of whichever autoscaler takes the empty lease adopts the fleet
    # and publishes its records (measured 0.16 s here; 0.05-0.7 s at the default 1 s tick): one tick and a late one.
    assert redis["members_back_s"] <= 2 * INTERVAL_S + SLACK_S
    assert redis["members_after"] == redis["members_before"]
    # A gateway that polled the empty store keeps its replicas (as unlisted) and lists them at its next poll.
    for gateway, listing_s in redis["gateways_listing_s"].items():
        assert listing_s <= redis["members_back_s"] + POLL_S + SLACK_S, gateway
    assert all(redis["gateways_still_listing_after_settle"].values())


def test_no_replica_was_started_twice_over_the_whole_run(scenario: dict) -> None:
    assert len(scenario["replicas_at_start"]) == NUM_REPLICAS
    assert scenario["replicas_at_end"] == scenario["replicas_at_start"]  # same ids, same live processes
    # and nothing else runs: every process writing to a replica log is one of those
    assert scenario["engine_processes_at_end"] == sorted(scenario["replicas_at_start"].values())
    assert len(scenario["replica_starts"]) == NUM_REPLICAS  # the first leader's starts, and no other


def test_the_steady_phase_fails_nothing(scenario: dict) -> None:
    assert all(row["failed"] == 0 for row in phase(scenario, "steady")["gateways"].values())
