"""The autoscaler's /metrics (issue 29): what the loop exports at each scrape, the listener's access rules, and
`kvgate autoscaler --metrics-port` as a real process on a real redis-server (a leader and a standby)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvgate.autoscaler.metrics import Provisioning, Reading, autoscaler_registry, families
from kvgate.exposition import render
from kvgate.autoscaler.metrics_server import metrics_access
from kvgate.clock import FakeClock
from kvgate.providers.fake import FakeProvider
from kvgate.state import MemoryStateStore, StateStoreError
from kvgate.state.records import AutoscalerStatus, ModelStatus, NodeStatus
from tests.autoscaler.fleet_helpers import load_test_registry, make_autoscaler, observe, write_registry
from tests.eventually import eventually_sync
from tests.metrics_text import samples, value
from tests.services import free_loopback_port


def node(node_id: str, pool: str, state: str, price: float, capacity_type: str = "on_demand") -> NodeStatus:
    return NodeStatus(id=node_id, pool=pool, instance_type="g5", capacity_type=capacity_type,
                      price_usd_per_hour=price, state=state)


def test_the_leader_exports_its_fleet_and_a_standby_only_that_it_waits() -> None:
    status = AutoscalerStatus(
        updated_at=1000.0, holder="a", cost_usd_total=12.5,
        models={"chat": ModelStatus(desired=3, ready=1, starting=2), "idle": ModelStatus(desired=0, ready=0, starting=0)},
        nodes=(node("n1", "aws", "running", 1.2, "spot"), node("n2", "aws", "running", 1.2, "spot"),
               node("n3", "aws", "pending", 4.0)))
    reading = Reading(leader=True, store_up=True, last_tick_at=999.5, pools=("aws", "onprem"), status=status,
                      provisioning=(Provisioning("aws", 880.0), Provisioning("aws", 950.0)))
    exported = {(s.name, frozenset(s.labels.items())): s.value for f in families(reading, now=1000.0) for s in f.samples}

    assert value(exported, "kvgate_autoscaler_leader") == 1
    assert value(exported, "kvgate_autoscaler_state_store_up") == 1
    assert value(exported, "kvgate_autoscaler_last_tick_timestamp_seconds") == 999.5
    assert value(exported, "kvgate_autoscaler_replicas_desired", model="chat") == 3
    assert value(exported, "kvgate_autoscaler_replicas_desired", model="idle") == 0
    assert value(exported, "kvgate_autoscaler_replicas", model="chat", state="starting") == 2
    assert value(exported, "kvgate_autoscaler_nodes", pool="aws", capacity_type="spot", state="running") == 2
    assert value(exported, "kvgate_autoscaler_nodes", pool="aws", capacity_type="on_demand", state="pending") == 1
    assert value(exported, "kvgate_autoscaler_node_cost_usd_per_hour", pool="aws") == pytest.approx(6.4)
    assert value(exported, "kvgate_autoscaler_node_cost_usd_per_hour", pool="onprem") == 0  # a pool with no node
    assert value(exported, "kvgate_autoscaler_cost_usd_total") == 12.5
    assert value(exported, "kvgate_autoscaler_provisioning_oldest_seconds", pool="aws") == 120  # 1000 - 880
    assert value(exported, "kvgate_autoscaler_provisioning_oldest_seconds", pool="onprem") == 0

    standby = families(Reading(leader=False, store_up=False, last_tick_at=None, pools=("aws",), status=status), 1000.0)
    assert {f.name for f in standby} == {"kvgate_autoscaler_leader", "kvgate_autoscaler_state_store_up"}
    assert [s.value for f in standby for s in f.samples] == [0, 0]


async def test_the_loop_reads_out_a_node_still_booting_and_its_age(tmp_path: Path) -> None:
    clock = FakeClock()
    store = MemoryStateStore(clock)
    snapshot = load_test_registry(tmp_path, node_boot_s=60)
    provider = FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock)
    autoscaler = make_autoscaler(snapshot, store, clock, provider)
    registry = autoscaler_registry(autoscaler.reading, clock.wall)
    assert value(samples(render(registry)[0].decode()), "kvgate_autoscaler_leader") == 0  # before the first tick

    await observe(store, clock, queued=3)
    await autoscaler.tick()  # buys a node that boots for 60 s
    await clock.advance(20)
    await observe(store, clock, queued=3)
    await autoscaler.tick()
    await clock.advance(5)
    exported = samples(render(registry)[0].decode())
    assert value(exported, "kvgate_autoscaler_leader") == 1
    assert value(exported, "kvgate_autoscaler_replicas_desired", model="m") == 1
    assert value(exported, "kvgate_autoscaler_nodes", pool="gpu", capacity_type="on_demand", state="pending") == 1
    assert value(exported, "kvgate_autoscaler_provisioning_oldest_seconds", pool="gpu") == 25  # bought at t=0
    assert value(exported, "kvgate_autoscaler_last_tick_timestamp_seconds") == clock.wall() - 5
    assert not [key for key in exported if key[0].endswith("_created")]


class FailingLeases(MemoryStateStore):
    """A store whose lease calls fail while `down` (Redis unreachable from this copy)."""

    down = False

    async def acquire_lease(self, *args: object, **kwargs: object) -> bool:
        if self.down:
            raise StateStoreError("redis down")
        return await super().acquire_lease(*args, **kwargs)


async def test_a_leader_cut_off_from_the_store_stops_saying_it_leads_once_its_lease_lapsed(tmp_path: Path) -> None:
    """Stale figures would fire alerts: the booting node's age would grow without end, and the lease alert would
    never see that nobody leads."""
    clock = FakeClock()
    store = FailingLeases(clock)
    snapshot = load_test_registry(tmp_path, node_boot_s=60)
    provider = FakeProvider("gpu", snapshot.pools["gpu"].spec, cluster="test", clock=clock)
    autoscaler = make_autoscaler(snapshot, store, clock, provider, lease_ttl_s=10.0)
    registry = autoscaler_registry(autoscaler.reading, clock.wall)
    await observe(store, clock, queued=3)
    await autoscaler.tick()  # leads, buys a node that boots for 60 s
    await clock.advance(20)
    await observe(store, clock, queued=3)
    await autoscaler.tick()  # the last renewal, at t=20; the node is still booting
    store.down = True
    seen = []
    for _ in range(30):
        await clock.advance(1)
        await autoscaler.tick()
        exported = samples(render(registry)[0].decode())
        seen.append((value(exported, "kvgate_autoscaler_leader"), value(exported, "kvgate_autoscaler_state_store_up"),
                     value(exported, "kvgate_autoscaler_provisioning_oldest_seconds", pool="gpu")))
    assert seen[0] == (1, 0, 21)  # t=21, within its lease: still the leader, the store reported down
    assert seen[8] == (1, 0, 29)
    assert seen[9:] == [(0, 0, None)] * 21  # from t=30, 10 s after its last renewal: no leader, no fleet


@pytest.mark.parametrize(("host", "token", "insecure", "refused", "level"), [
    ("127.0.0.1", None, False, False, logging.INFO),
    ("0.0.0.0", None, False, True, None),
    ("0.0.0.0", "  ", False, True, None),  # a blank token is no token
    ("0.0.0.0", None, True, False, logging.WARNING),
    ("0.0.0.0", "s3cret", False, False, None),
])
def test_metrics_beyond_loopback_need_a_token_or_the_insecure_flag(host: str, token: str | None, insecure: bool,
                                                                   refused: bool, level: int | None) -> None:
    access = metrics_access(host, token, insecure)
    assert (access.refusal is not None) == refused
    assert (access.notice[0] if access.notice else None) == level
    if access.refusal is not None:
        assert "KVGATE_METRICS_TOKEN" in access.refusal and "--insecure-open-metrics" in access.refusal


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError:  # not listening yet
        return 0, ""


def test_a_leader_and_a_standby_process_serve_their_metrics_behind_the_token(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "registry").mkdir()
    registry = write_registry(tmp_path / "registry")
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    env = {"KVGATE_METRICS_TOKEN": "scrape-me", "PATH": "/usr/bin:/bin"}
    ports, processes = [free_loopback_port(), free_loopback_port()], []
    try:
        for holder, port in zip(("first", "second"), ports, strict=True):
            log = open(tmp_path / f"{holder}.log", "wb")  # noqa: SIM115 - closed with the process below
            processes.append((subprocess.Popen(
                [sys.executable, "-m", "kvgate.autoscaler", "--registry", str(registry), "--state", redis_url,
                 "--key-prefix", prefix, "--interval-s", "0.2", "--holder", holder, "--metrics-port", str(port),
                 "--metrics-host", "0.0.0.0"], stdout=log, stderr=subprocess.STDOUT, env=env), log))
            if holder == "first":  # the first takes the lease before the second starts
                eventually_sync(lambda: "kvgate_autoscaler_leader 1.0" in get(
                    f"http://127.0.0.1:{ports[0]}/metrics", "scrape-me")[1], "the first copy leads", 30, poll_s=0.2)
        eventually_sync(lambda: get(f"http://127.0.0.1:{ports[1]}/health")[0] == 200, "the standby is up", 30,
                        poll_s=0.2)

        status, body = get(f"http://127.0.0.1:{ports[0]}/metrics")
        assert status == 401 and "invalid_metrics_token" in body and "scrape-me" not in body
        assert get(f"http://127.0.0.1:{ports[0]}/metrics", "wrong")[0] == 401
        leader = samples(get(f"http://127.0.0.1:{ports[0]}/metrics", "scrape-me")[1])
        standby = samples(get(f"http://127.0.0.1:{ports[1]}/metrics", "scrape-me")[1])
        assert value(leader, "kvgate_autoscaler_leader") == 1 and value(standby, "kvgate_autoscaler_leader") == 0
        assert value(leader, "kvgate_autoscaler_replicas_desired", model="m") == 0
        assert value(leader, "kvgate_autoscaler_node_cost_usd_per_hour", pool="gpu") == 0
        assert value(standby, "kvgate_autoscaler_state_store_up") == 1
        assert value(standby, "kvgate_autoscaler_replicas_desired", model="m") is None  # only the leader says
    finally:
        for process, log in processes:
            process.terminate()
            process.wait(timeout=30)
            log.close()


def test_a_metrics_port_that_cannot_be_served_is_one_line_and_an_exit_status(tmp_path: Path) -> None:
    (tmp_path / "registry").mkdir()
    registry = write_registry(tmp_path / "registry")
    done = subprocess.run([sys.executable, "-m", "kvgate.autoscaler", "--registry", str(registry), "--state",
                           "memory://", "--metrics-port", str(free_loopback_port()), "--metrics-host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("kvgate autoscaler: --metrics-host 0.0.0.0 is beyond loopback")
    bad = subprocess.run([sys.executable, "-m", "kvgate.autoscaler", "--registry", str(registry), "--state",
                          "memory://", "--metrics-port", "70000"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "a port is 1-65535, not 70000" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "kvgate.autoscaler", "--registry", str(registry), "--state",
                               "memory://", "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1 and "Traceback" not in busy.stderr
    assert busy.stderr.startswith(f"kvgate autoscaler: cannot listen on 127.0.0.1:{port}: ")
