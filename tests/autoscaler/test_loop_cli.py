"""`kvgate autoscaler` as a real process against a real redis-server: it takes the lease, scales a model
from a gateway observation, reloads the registry while running, and on SIGTERM releases the lease and
exits 0 leaving its nodes. Bad input gets one clear line and a non-zero exit, never a traceback.

The pool in the test registry uses the `fake` provider (in memory, inside the autoscaler process): the
closest honest stand-in for a cloud here; the state store and the process are real.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from kvgate.autoscaler.claims import ClaimStore
from kvgate.clock import RealClock
from kvgate.state import RedisStateStore
from tests.autoscaler.fleet_helpers import write_registry
from tests.eventually import eventually_sync
from tests.services import asks_for_a_password, free_loopback_port, running

PASSWORD = "hunter2"

SECOND_MODEL = """\
apiVersion: kvgate/v1
kind: Model
metadata: {name: m2}
spec:
  source: builtin:tiny-llama
  resources: {gpu_kinds: [L4], gpu_count: 1}
  scaling: {min_replicas: 0, max_replicas: 1, max_queue_wait_s: 30}
  placement: {pools: [gpu]}
"""


def in_redis(url: str, prefix: str, action):
    async def run():
        store = RedisStateStore.from_url(url, RealClock(), prefix=prefix)
        try:
            return await action(store)
        finally:
            await store.close()
    return asyncio.run(run())


def wait_for(condition, timeout_s: float, what: str, log_path: Path):
    return eventually_sync(condition, lambda: f"{what}; autoscaler log:\n{log_path.read_text()[-3000:]}",
                           timeout_s, poll_s=0.1)


def status_of(url: str, prefix: str):
    async def get(store):
        record = await store.get_record("autoscaler", "status")
        return None if record is None else record.data
    return in_redis(url, prefix, get)


def test_the_process_scales_reloads_and_stops_cleanly_on_sigterm(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "registry").mkdir()
    registry = write_registry(tmp_path / "registry")
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    log_path = tmp_path / "autoscaler.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate.autoscaler", "--registry", str(registry), "--state", redis_url,
             "--key-prefix", prefix, "--cluster", "cli-test", "--interval-s", "0.2", "--holder", "cli"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        async def gateway_holds_three(store):
            await store.put_record("observations", "m@g1", {
                "model": "m", "gateway_id": "g1", "queued": 3, "in_flight": 0, "arrivals_per_s": 0.0,
                "ttft_p99_s": None, "updated_at": time.time()})

        in_redis(redis_url, prefix, gateway_holds_three)
        status = wait_for(lambda: (s := status_of(redis_url, prefix)) and s["models"]["m"]["ready"] == 1 and s,
                          20, "model m to have a ready replica", log_path)
        assert status["holder"] == "cli" and len(status["nodes"]) == 1
        members = in_redis(redis_url, prefix, lambda store: store.list_members("m"))
        assert [m.state.value for m in members] == ["ready"]

        (registry / "second.yaml").write_text(SECOND_MODEL)  # hot reload: a new model appears
        wait_for(lambda: "m2" in (status_of(redis_url, prefix) or {}).get("models", {}), 20,
                 "the reloaded registry's model m2 in the status record", log_path)

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert in_redis(redis_url, prefix, lambda store: store.lease_holder("autoscaler")) is None
    # the node was not deleted on the way out: its claim is still there for the next autoscaler to adopt
    claims = in_redis(redis_url, prefix, lambda store: ClaimStore(store, "reader").list())
    assert [(c.phase.value, c.node_id) for c in claims] == [("confirmed", status["nodes"][0]["id"])]
    assert "left running for the next autoscaler to adopt" in log_path.read_text()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgate.autoscaler", *args], capture_output=True, text=True, timeout=60)


def test_an_invalid_registry_is_reported_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("apiVersion: kvgate/v1\nkind: Model\nmetadata: {name: m}\nspec:\n"
                                       "  source: builtin:tiny-llama\n  scaling: {min_replicas: -1}\n")
    done = run_cli("--registry", str(tmp_path), "--state", "memory://")
    assert done.returncode == 2
    assert "bad.yaml:" in done.stderr and "min_replicas" in done.stderr and "Traceback" not in done.stderr
    missing = run_cli("--registry", str(tmp_path / "nowhere"), "--state", "memory://")
    assert missing.returncode == 2 and "nowhere: does not exist" in missing.stderr
    assert missing.stderr.startswith("kvgate autoscaler: ") and "Traceback" not in missing.stderr


def test_a_bad_state_url_is_a_one_line_error(tmp_path: Path) -> None:
    registry = write_registry(tmp_path)
    unknown = run_cli("--registry", str(registry), "--state", "postgres://db/0")
    assert unknown.returncode == 2 and "unknown scheme 'postgres'" in unknown.stderr
    assert "Traceback" not in unknown.stderr and len(unknown.stderr.strip().splitlines()) == 1


def log_stamps(log: str, marker: str) -> list[float]:
    """Epoch seconds of the log lines holding `marker` (the CLI's asctime, "2026-01-02 03:04:05,678")."""
    return [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for line in log.splitlines() if marker in line]


def test_an_autoscaler_started_before_redis_waits_for_it_and_then_leads(tmp_path: Path) -> None:
    # In Kubernetes the autoscaler pod may start before the Redis StatefulSet: exiting would only put it in a
    # crash loop whose back-off (up to 5 min) outlasts Redis's start. It waits as standby instead, and says so when
    # the wait begins and then once a minute, not at every tick.
    (tmp_path / "registry").mkdir()
    registry = write_registry(tmp_path / "registry", min_replicas=1)
    port = free_loopback_port()
    # The password comes from the environment, as the Helm chart gives it, so it is in no process argument.
    state = f"redis://127.0.0.1:{port}/0"
    log_path = tmp_path / "autoscaler.log"
    interval_s = 0.5
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate.autoscaler", "--registry", str(registry), "--state", state,
             "--cluster", "late-redis", "--interval-s", str(interval_s), "--holder", "early"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KVGATE_REDIS_PASSWORD": PASSWORD})
    try:
        wait_for(lambda: log_stamps(log_path.read_text(), "unreachable"), 30, "a tick that found no Redis", log_path)
        time.sleep(6 * interval_s)  # six more ticks that find none
        assert process.poll() is None  # still there, waiting
        redis_command = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                         "--save", "", "--appendonly", "no", "--requirepass", PASSWORD, "--dir", str(tmp_path)]
        with running(redis_command, name="redis-server", ready=lambda: asks_for_a_password(port), timeout_s=10,
                     log_path=tmp_path / "redis.log"):
            wait_for(lambda: "lease_acquired: early is the active autoscaler" in log_path.read_text(), 30,
                     "the autoscaler to take the lease once Redis is up", log_path)
            status = wait_for(lambda: status_of(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", "kvgate:"), 30,
                              "its status record", log_path)
            assert status["holder"] == "early"
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = log_path.read_text()
    # One line when the wait began; the count of the ticks that failed (about six: 0.5 s apart plus the ~0.1-0.2 s
    # a refused connection and its two retries take) comes with the line that says it is over.
    [wait] = [line for line in log.splitlines() if "unreachable" in line]
    assert f"state store redis://127.0.0.1:{port}/0 unreachable: Error 111" in wait
    [answers] = [line for line in log.splitlines() if "the state store answers again after" in line]
    assert int(answers.split(" failed tr")[0].rsplit(" ", 1)[1]) >= 4, answers
    assert "Traceback" not in log and PASSWORD not in log


def test_the_kvgate_command_forwards_to_the_autoscaler_help() -> None:
    done = subprocess.run([sys.executable, "-m", "kvgate.cli", "autoscaler", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--registry DIR" in done.stdout and "leaves every node" in done.stdout
