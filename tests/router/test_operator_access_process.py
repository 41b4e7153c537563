"""`kvgate router` and `kvgate up` as processes: beyond loopback without an admin token they refuse to start
(exit 2, one line saying what to do) unless told `--insecure-open-admin`, which they say as a WARNING; tokens
come from the environment and never reach the log. Pure rules and the endpoints themselves: test_operator_access.py.
"""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvgate.router.operator_access import ADMIN_TOKEN_ENV, INSECURE_FLAG, METRICS_TOKEN_ENV
from tests.registry_docs import static_model
from tests.services import free_loopback_port, http_answers, kvgate_command, running

ADMIN = "adm1n-s3cret-token"
METRICS = "scr4pe-s3cret-token"
# A static replica nothing listens on, with weights kvgate up need not prepare: the processes start in seconds.
REGISTRY = static_model("http://127.0.0.1:9").replace("builtin:tiny-llama", "example/not-prepared")


@pytest.fixture(autouse=True)
def no_tokens_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The children inherit this environment: each test sets the tokens it means."""
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(METRICS_TOKEN_ENV, raising=False)


def status_of(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code


def registry(tmp_path: Path) -> Path:
    (tmp_path / "registry").mkdir(exist_ok=True)
    (tmp_path / "registry" / "models.yaml").write_text(REGISTRY)
    return tmp_path / "registry"


@pytest.mark.parametrize("command", ["router", "up"])
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_beyond_loopback_without_an_admin_token_it_exits_2_saying_how_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, host: str) -> None:
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS)  # a metrics token alone leaves /admin/* open: still refused
    done = subprocess.run([*kvgate_command(), command, "--registry", str(registry(tmp_path)), "--host", host,
                           "--port", str(free_loopback_port())], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"kvgate {command}: refusing to listen on {host}")
    assert ADMIN_TOKEN_ENV in line and INSECURE_FLAG in line and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["router", "up"])
def test_insecure_open_admin_starts_beyond_loopback_and_warns(tmp_path: Path, command: str) -> None:
    port = free_loopback_port()
    url, log_path = f"http://127.0.0.1:{port}", tmp_path / f"{command}.log"
    argv = [*kvgate_command(), command, "--registry", str(registry(tmp_path)), "--host", "0.0.0.0",
            "--port", str(port), INSECURE_FLAG]
    with running(argv, name=f"kvgate {command}", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                 log_path=log_path) as process:
        assert status_of(url + "/admin/stats") == 200 and status_of(url + "/metrics") == 200
    assert process.returncode == 0
    [warning] = [line for line in log_path.read_text().splitlines() if "INSECURE" in line]
    assert f"({INSECURE_FLAG}): listening on 0.0.0.0" in warning and "no token (OPEN)" in warning
    if command == "router":  # kvgate up's log format has no level name
        assert " WARNING " in warning


def test_with_tokens_from_the_environment_it_starts_beyond_loopback_and_guards_both_endpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS)
    port = free_loopback_port()
    url, log_path = f"http://127.0.0.1:{port}", tmp_path / "router.log"
    argv = [*kvgate_command(), "router", "--registry", str(registry(tmp_path)), "--host", "0.0.0.0",
            "--port", str(port), "--log-level", "DEBUG"]
    with running(argv, name="kvgate router", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                 log_path=log_path):
        assert [status_of(url + "/metrics", token) for token in (None, "wrong", METRICS, ADMIN)] == [401, 401, 200, 200]
        assert [status_of(url + "/admin/stats", token) for token in (None, METRICS, ADMIN)] == [401, 401, 200]
    log = log_path.read_text()
    assert f"/metrics needs ${METRICS_TOKEN_ENV} or the admin token" in log
    assert ADMIN not in log and METRICS not in log and "INSECURE" not in log


def test_the_deprecated_admin_token_flag_still_guards_and_says_to_use_the_environment(tmp_path: Path) -> None:
    port = free_loopback_port()
    url, log_path = f"http://127.0.0.1:{port}", tmp_path / "router.log"
    argv = [*kvgate_command(), "router", "--registry", str(registry(tmp_path)), "--port", str(port),
            "--admin-token", ADMIN]
    with running(argv, name="kvgate router", ready=lambda: http_answers(url + "/health"), timeout_s=60,
                 log_path=log_path):
        assert [status_of(url + "/admin/stats", token) for token in (None, ADMIN)] == [401, 200]
        assert status_of(url + "/metrics") == 401
    log = log_path.read_text()
    assert "WARNING" in log and "--admin-token is deprecated" in log and f"set ${ADMIN_TOKEN_ENV}" in log
    assert log.count(ADMIN) == 0
