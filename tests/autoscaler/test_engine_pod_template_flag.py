"""`kvgate autoscaler --engine-pod-template FILE` (the Helm chart mounts the rendered template there) and
the state URL's password: a bad template stops the process at start with one line naming the file and
the problem; a password never reaches the output."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.autoscaler.fleet_helpers import write_registry
from tests.eventually import eventually_sync
from tests.services import free_loopback_port


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgate.autoscaler", *args], capture_output=True, text=True, timeout=60)


def test_a_template_with_kvgate_owned_fields_stops_the_start(tmp_path: Path) -> None:
    template = tmp_path / "engine-pod-template.yaml"
    template.write_text("spec:\n  containers:\n    - name: engine\n      args: [--port, '9000']\n")
    done = run_cli("--registry", str(write_registry(tmp_path)), "--state", "memory://",
                   "--engine-pod-template", str(template))
    assert done.returncode == 2
    assert done.stderr == (f"kvgate autoscaler: --engine-pod-template {template}: spec.containers[0].args: kvgate "
                           "sets it from the registry Model; remove it\n")


def test_a_missing_or_unparsable_template_is_one_line_naming_the_file(tmp_path: Path) -> None:
    registry = str(write_registry(tmp_path))
    missing = run_cli("--registry", registry, "--state", "memory://", "--engine-pod-template", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert f"{tmp_path / 'nope'}: cannot read it: No such file or directory" in missing.stderr
    garbled = tmp_path / "garbled.yaml"
    garbled.write_text("spec: [unclosed\n")
    broken = run_cli("--registry", registry, "--state", "memory://", "--engine-pod-template", str(garbled))
    assert broken.returncode == 2 and f"{garbled}: not valid YAML" in broken.stderr
    for done in (missing, broken):
        assert "Traceback" not in done.stderr


def test_the_state_password_is_not_printed(tmp_path: Path) -> None:
    """The chart passes the Redis password inside --state (from a Secret, through $(REDIS_PASSWORD))."""
    port = free_loopback_port()  # nothing listens: the autoscaler waits as standby and says so
    log_path = tmp_path / "autoscaler.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate.autoscaler", "--registry", str(write_registry(tmp_path)),
             "--state", f"redis://:hunter2@127.0.0.1:{port}/0", "--interval-s", "0.2"],
            stdout=log, stderr=subprocess.STDOUT)
    try:  # the start-up line, then a standby tick logging the store it cannot reach (and then one a minute)
        eventually_sync(lambda: "acting as standby this tick" in log_path.read_text(),
                        lambda: f"a standby tick in the log:\n{log_path.read_text()[-3000:]}")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
    output = log_path.read_text()
    assert f"state redis://:***@127.0.0.1:{port}/0" in output  # the start-up line
    assert "hunter2" not in output
