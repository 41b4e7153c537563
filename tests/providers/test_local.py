"""LocalProvider with real `kvgate engine` child processes on builtin:tiny-llama (weights from the repo's
shared .kvgate-cache, nothing downloaded): health, a real completion, a kill from outside, a restart
that adopts, and no process left behind.

Liveness is checked through /proc (`providers.local_proc`) and os.kill(pid, 0), not psutil."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgate.clock import RealClock
from kvgate.providers.base import NotFound, QuotaExceeded, ReplicaSpec, ReplicaState, replica_spec_for
from kvgate.providers.build import build_provider
from kvgate.providers.local import LocalProvider
from kvgate.providers.local_proc import group_members, is_alive, proc_stat
from kvgate.registry.schema import ModelDoc
from tests.engine.builtin_cache import shared_cache_dir, tiny_llama_dir
from tests.eventually import eventually
from tests.providers.subject_local import POOL, claim, pool_spec

MODEL = ModelDoc.model_validate({
    "apiVersion": "kvgate/v1", "kind": "Model", "metadata": {"name": "tiny"},
    "spec": {"source": "builtin:tiny-llama", "engine": {"kv_cache_bytes": "8MiB", "max_model_len_tokens": 256}},
})
READY_TIMEOUT_S = 60.0  # ~3 s for two replicas on a quiet 2-core box; generous for loaded CI


def make_provider(work_dir: Path, **options) -> LocalProvider:
    return LocalProvider(POOL, pool_spec(work_dir), cluster="c1", clock=RealClock(), cache_dir=shared_cache_dir(),
                         **options)


def pid_file(provider: LocalProvider, replica_id: str) -> dict:
    return json.loads((provider.work_dir / "replicas" / f"{replica_id}.json").read_text())


def gone(pid: int, start_ticks: int) -> bool:
    """The process is not running (absent, or a zombie awaiting its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return not is_alive(pid, start_ticks)


def http_get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status


def complete(url: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
async def work_dir(tmp_path: Path) -> AsyncIterator[Path]:
    """The pool's work dir; whatever a test leaves running there is stopped afterwards (and reported)."""
    tiny_llama_dir()  # built once per checkout, before any engine looks for it
    yield tmp_path / "local"
    cleaner = make_provider(tmp_path / "local")
    await cleaner.stop_all(drain_deadline_s=0)


async def test_two_replicas_serve_survive_a_restart_and_leave_nothing_behind(work_dir: Path) -> None:
    provider = make_provider(work_dir)
    node = await provider.create(claim())
    spec = replica_spec_for(MODEL)
    first = await provider.start_replica(node.id, spec)
    second = await provider.start_replica(node.id, spec)
    assert first.state is second.state is ReplicaState.STARTING
    ready = await asyncio.gather(provider.wait_ready(first.id, READY_TIMEOUT_S),
                                 provider.wait_ready(second.id, READY_TIMEOUT_S))
    assert [r.state for r in ready] == [ReplicaState.READY] * 2, [r.reason for r in ready]

    # Really healthy: /health answers 200 and a completion comes back from each.
    for replica in ready:
        assert await asyncio.to_thread(http_get, f"{replica.url}/health") == 200
        answer = await asyncio.to_thread(complete, replica.url, "tiny")
        assert answer["model"] == "tiny" and answer["usage"]["completion_tokens"] == 4

    # The pid file says enough to find the process again and not mistake a recycled pid for it.
    record = pid_file(provider, first.id)
    assert record["model"] == "tiny" and record["id"] == first.id and record["node_id"] == node.id
    assert first.url.endswith(f":{record['http_port']}") and first.grpc_target.endswith(f":{record['grpc_port']}")
    assert proc_stat(record["pid"]).start_ticks == record["start_ticks"]
    assert proc_stat(record["pid"]).pgid == record["pid"], "each replica leads its own process group"
    assert "engine" in " ".join(record["cmdline"]) and "--served-model-name" in record["cmdline"]

    # Killed from outside: reported FAILED, saying how, with the end of its log.
    victim = pid_file(provider, second.id)
    os.kill(victim["pid"], signal.SIGKILL)
    states = await replicas_once(provider, lambda found: found[second.id].state is not ReplicaState.READY,
                                 "the killed replica no longer READY")
    assert states[first.id].state is ReplicaState.READY
    assert states[second.id].state is ReplicaState.FAILED
    assert "killed by SIGKILL" in states[second.id].reason and "kvgate engine" in states[second.id].reason

    # kvgate restarts: a new provider on the same work dir finds the node and adopts the live replica.
    await provider.close()
    restarted = make_provider(work_dir)
    assert [n.id for n in await restarted.list()] == [node.id]
    assert (await restarted.create(claim_with_id(node.claim_id))).id == node.id, "idempotent across restarts"
    adopted = {r.id: r for r in await restarted.list_replicas()}
    assert adopted[first.id].state is ReplicaState.READY
    assert adopted[second.id].state is ReplicaState.FAILED
    assert await asyncio.to_thread(http_get, f"{adopted[first.id].url}/health") == 200

    # Stop everything: no process of either replica's group survives, pid files are gone.
    started = time.monotonic()
    await restarted.stop_replica(first.id, drain_deadline_s=10.0)
    await restarted.stop_replica(second.id, drain_deadline_s=0.0)
    assert time.monotonic() - started < 10.0, "an idle engine drains at once on SIGTERM"
    for each in (record, victim):
        assert gone(each["pid"], each["start_ticks"])
        assert group_members(each["pgid"], each["start_ticks"]) == []
    assert await restarted.list_replicas() == []
    assert list((work_dir / "replicas").glob("*.json")) == []
    await restarted.delete(node.id)
    assert await restarted.list() == []


async def replicas_once(provider: LocalProvider, condition, what: str) -> dict:
    """The replicas by id once `condition(replicas by id)` holds (a SIGKILL takes a moment to land)."""
    async def found_if() -> dict:
        found = {r.id: r for r in await provider.list_replicas()}
        return found if condition(found) else {}
    return await eventually(found_if, what, poll_s=0.02)


def claim_with_id(claim_id: str):
    fresh = claim()
    return type(fresh)(id=claim_id, offering=fresh.offering, model=fresh.model)


async def test_a_replica_that_cannot_start_is_failed_with_its_log(work_dir: Path) -> None:
    provider = make_provider(work_dir)
    node = await provider.create(claim())
    broken = ReplicaSpec(model="ghost", source=str(work_dir / "no-such-model-dir"))
    replica = await provider.start_replica(node.id, broken, replica_id="ghost-1")
    handle = await provider.wait_ready(replica.id, READY_TIMEOUT_S)
    assert handle.state is ReplicaState.FAILED
    assert "exited with code" in handle.reason and "no-such-model-dir" in handle.reason
    again = await provider.start_replica(node.id, broken, replica_id="ghost-1")
    assert again.state is ReplicaState.FAILED, "start_replica with a known id returns that replica"
    await provider.stop_replica(replica.id, drain_deadline_s=0)
    assert await provider.list_replicas() == []


STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("stubborn up", flush=True)
    time.sleep(60)
""")


async def test_stop_kills_the_whole_tree_after_the_drain_deadline(work_dir: Path) -> None:
    """Stand-in for an engine that ignores SIGTERM and has a helper process: a Python script (the engine
    itself drains and exits on SIGTERM, as the first test shows). Its /health never answers."""
    provider = make_provider(work_dir, command=[sys.executable, "-c", STUBBORN])
    node = await provider.create(claim())
    replica = await provider.start_replica(node.id, ReplicaSpec(model="m", source="builtin:tiny-llama"))
    record = pid_file(provider, replica.id)
    await eventually(lambda: len(group_members(record["pgid"], record["start_ticks"])) >= 2,
                     "the script and its helper both running", poll_s=0.02)
    members = [(pid, proc_stat(pid).start_ticks) for pid in group_members(record["pgid"], record["start_ticks"])]
    assert len(members) == 2, "the script and its helper"
    assert (await provider.list_replicas())[0].state is ReplicaState.STARTING
    started = time.monotonic()
    await provider.stop_replica(replica.id, drain_deadline_s=0.5)
    took = time.monotonic() - started
    assert 0.5 <= took < 5.0, took
    for pid, start_ticks in members:
        assert gone(pid, start_ticks)
    assert group_members(record["pgid"], record["start_ticks"]) == []


async def test_a_recycled_pid_is_not_mistaken_for_a_replica(work_dir: Path) -> None:
    """A pid file whose pid now belongs to another process (same pid, later start time): the replica is
    reported FAILED and the stranger, itself a group leader with that id, is left alone."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ticks = proc_stat(stranger.pid).start_ticks
        provider = make_provider(work_dir)
        node = await provider.create(claim())
        (work_dir / "replicas").mkdir(parents=True)
        record = {"id": "old-1", "cluster": "c1", "pool": POOL, "node_id": node.id, "model": "tiny",
                  "pid": stranger.pid, "pgid": stranger.pid, "start_ticks": ticks - 1, "cmdline": ["kvgate", "engine"],
                  "host": "127.0.0.1", "http_port": 1, "grpc_port": 2, "started_at": 0.0,
                  "log": str(work_dir / "replicas" / "old-1.log"), "failed": None}
        (work_dir / "replicas" / "old-1.json").write_text(json.dumps(record))
        [handle] = await make_provider(work_dir).list_replicas()
        assert handle.state is ReplicaState.FAILED and "while no kvgate was watching" in handle.reason
        await make_provider(work_dir).stop_replica("old-1", drain_deadline_s=0)
        assert stranger.poll() is None, "the stranger still runs"
    finally:
        stranger.kill()
        stranger.wait()


async def test_slots_are_the_pools_quota(work_dir: Path) -> None:
    provider = make_provider(work_dir)
    nodes = [await provider.create(claim()) for _ in range(2)]
    assert sorted(n.id for n in nodes) == [f"{POOL}-slot-0", f"{POOL}-slot-1"]
    with pytest.raises(QuotaExceeded, match="2 slot"):
        await provider.create(claim())
    await provider.delete(nodes[0].id)
    assert (await provider.create(claim())).id == nodes[0].id, "a freed slot is reused"
    with pytest.raises(NotFound):
        await provider.start_replica("local-pool-slot-9", replica_spec_for(MODEL))
    with pytest.raises(ValueError, match="names files"):
        await provider.start_replica(nodes[1].id, replica_spec_for(MODEL), replica_id="../escape")


async def test_build_provider_picks_local(work_dir: Path) -> None:
    provider = build_provider(POOL, pool_spec(work_dir), cluster="c1", clock=RealClock(), cache_dir=shared_cache_dir())
    assert isinstance(provider, LocalProvider) and provider.work_dir == work_dir
    offerings = await provider.offerings()
    assert [(o.instance_type, o.region, o.available) for o in offerings] == [("this-machine", "local", True)]
