"""`kvgate up` given bad input: a registry that does not validate, an adapter directory that is not
there, a port in use. Each is a real `kvgate up` process that must exit 1 with every problem (file:line)
or a one-line error, having started nothing. Plus the pure helpers behind its progress log."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from kvgate.stack import Progress, display_host, failed_models_of, missing_adapter_sources, progress_step, urls_banner
from kvgate.state import AutoscalerStatus, MemberRecord, ReplicaState
from kvgate.state.records import StatusEvent
from kvgate.registry import load_registry
from tests.e2e.up_process import run_up
from tests.services import free_loopback_port

MODEL = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: tiny-llama}}
spec:
  source: builtin:tiny-llama
  scaling: {{min_replicas: {min_replicas}, max_queue_wait_s: 30}}
"""
POOL = """\
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: local}}
spec:
  provider: local
  offers: [{{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}}]
  local: {{work_dir: "{work}"}}
"""


def write_registry(root: Path, files: dict[str, str]) -> Path:
    registry = root / "registry"
    registry.mkdir()
    for name, text in files.items():
        (registry / name).write_text(text)
    return registry


def run_to_exit(registry: Path, port: int, tmp_path: Path) -> tuple[int, str]:
    log = tmp_path / "up.log"
    process = run_up(registry, port, log)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"kvgate up kept running on bad input:\n{log.read_text()}")
    return code, log.read_text()


def test_an_invalid_registry_prints_every_problem_with_file_and_line_and_starts_nothing(tmp_path: Path) -> None:
    registry = write_registry(tmp_path, {
        "models.yaml": MODEL.format(min_replicas=-1),
        "pools.yaml": POOL.format(work=tmp_path / "work").replace("price_usd_per_hour: 0", "price_usd_per_hour: -3"),
    })
    port = free_loopback_port()
    code, output = run_to_exit(registry, port, tmp_path)
    assert code == 1
    assert f"{registry}/models.yaml:6: Model/tiny-llama: spec.scaling.min_replicas" in output
    assert f"{registry}/pools.yaml:" in output and "price_usd_per_hour" in output
    assert "Traceback" not in output
    assert not (tmp_path / "work").exists()  # no node, no replica
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # the gateway never listened


def test_a_missing_adapter_directory_is_reported_at_its_document_before_anything_starts(tmp_path: Path) -> None:
    adapter = ("---\napiVersion: kvgate/v1\nkind: Adapter\nmetadata: {name: sql}\n"
               f"spec: {{base_model: tiny-llama, source: {tmp_path}/no-such-adapter, rank: 4}}\n")
    registry = write_registry(tmp_path, {"models.yaml": MODEL.format(min_replicas=0) + adapter,
                                         "pools.yaml": POOL.format(work=tmp_path / "work")})
    code, output = run_to_exit(registry, free_loopback_port(), tmp_path)
    assert code == 1
    assert f"{registry}/models.yaml:8: Adapter/sql: spec.source: '{tmp_path}/no-such-adapter' is not a directory" \
        in output
    assert not (tmp_path / "work").exists()


def test_a_port_in_use_is_a_one_line_error_naming_the_port(tmp_path: Path) -> None:
    registry = write_registry(tmp_path, {"models.yaml": MODEL.format(min_replicas=1),
                                         "pools.yaml": POOL.format(work=tmp_path / "work")})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = run_to_exit(registry, port, tmp_path)
    assert code == 1
    last = output.strip().splitlines()[-1]
    assert last == (f"kvgate up: port {port} on 127.0.0.1 is already in use; stop what uses it or pick another "
                    "with --port")
    assert "Traceback" not in output
    assert not (tmp_path / "work").exists()  # the model's min_replicas 1 was never started


# --------------------------------------------------------------------------------- pure helpers


def member(replica_id: str, state: ReplicaState, model: str = "m") -> MemberRecord:
    return MemberRecord(replica_id=replica_id, model=model, url=f"http://127.0.0.1:1/{replica_id}", state=state)


def test_progress_logs_each_replica_transition_once_and_the_banner_when_min_replicas_are_ready() -> None:
    wanted = {"m": 1}
    progress, lines, due = progress_step(Progress(), [member("r1", ReplicaState.STARTING)], 10.0, wanted, ())
    assert lines == ["m: replica r1 starting (loading the model) at http://127.0.0.1:1/r1"] and not due
    progress, lines, due = progress_step(progress, [member("r1", ReplicaState.STARTING)], 11.0, wanted, ())
    assert lines == [] and not due
    progress, lines, due = progress_step(progress, [member("r1", ReplicaState.READY)], 14.5, wanted, ())
    assert lines == ["m: replica r1 ready at http://127.0.0.1:1/r1 (4.5 s after it was seen starting)"] and due
    progress, lines, due = progress_step(progress, [], 20.0, wanted, ())
    assert lines == ["replica r1 is gone"] and not due  # the banner is shown once


def test_the_banner_is_due_when_a_model_that_must_run_has_failed_instead() -> None:
    _, _, due = progress_step(Progress(), [member("r1", ReplicaState.READY, "a")], 1.0, {"a": 1, "b": 1}, ())
    assert not due
    _, _, due = progress_step(Progress(), [member("r1", ReplicaState.READY, "a")], 1.0, {"a": 1, "b": 1}, {"b"})
    assert due
    status = AutoscalerStatus(updated_at=0.0, events=(StatusEvent(0.0, "b", "replica_failed", ""),
                                                      StatusEvent(0.0, "a", "replica_start", "")))
    assert failed_models_of(status) == {"b"}
    assert failed_models_of(None) == set()


def test_urls_use_loopback_for_a_wildcard_bind() -> None:
    assert display_host("0.0.0.0") == "127.0.0.1" and display_host("::1") == "[::1]"
    assert "OpenAI base URL  http://127.0.0.1:8080/v1" in urls_banner("0.0.0.0", 8080)
    assert "dashboard        http://127.0.0.1:8080/dashboard" in urls_banner("0.0.0.0", 8080)


def test_relative_adapter_sources_resolve_against_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "r.yaml").write_text(
        MODEL.format(min_replicas=1) + "---\napiVersion: kvgate/v1\nkind: Adapter\nmetadata: {name: sql}\n"
        "spec: {base_model: tiny-llama, source: adapters/sql, rank: 4}\n---\n" + POOL.format(work=tmp_path / "w"))
    snapshot = load_registry(tmp_path / "r.yaml")
    assert missing_adapter_sources(snapshot, tmp_path) == []
    [problem] = missing_adapter_sources(snapshot, tmp_path / "elsewhere")
    assert (problem.line, problem.document, problem.path) == (8, "Adapter/sql", ("spec", "source"))
