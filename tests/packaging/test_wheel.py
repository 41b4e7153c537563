"""The distribution as a user gets it: a wheel built from the checkout's files alone (no .venv, no build
leftovers), installed into a fresh virtualenv without torch, then run from outside the checkout.

One wheel and one virtualenv per module (~40 s: pip resolves the gateway's dependencies from its cache).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services import free_loopback_port, http_answers, running

REPO = Path(__file__).resolve().parents[2]
SUBSYSTEMS = ("registry", "engine", "router", "autoscaler", "providers")


def version_in_source() -> str:
    """`__version__` as kvgate/__init__.py writes it, read without importing anything."""
    for node in ast.parse((REPO / "kvgate" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("kvgate/__init__.py sets no __version__")


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    workdir: Path  # outside the checkout, so nothing of the repository shadows the installed package

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return subprocess.run(list(argv), cwd=self.workdir, env=env, capture_output=True, text=True, timeout=timeout_s)


def checkout_files(destination: Path) -> None:
    """Copy what a fresh clone would hold (tracked files, plus new files git does not ignore) to `destination`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    with tarfile.open(destination / "src.tar", "w") as archive:
        for name in filter(None, listed):
            path = REPO / name.decode()
            if path.is_file():
                archive.add(path, arcname=f"src/{name.decode()}")
    with tarfile.open(destination / "src.tar") as archive:
        archive.extractall(destination, filter="data")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    checkout_files(root)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(root / "dist"),
                            str(root / "src")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, f"pip wheel failed on a clean copy of the checkout:\n{built.stderr[-3000:]}"
    [wheel] = (root / "dist").glob("kvgate-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)], capture_output=True,
                         text=True, timeout=600)
    assert pip.returncode == 0, f"pip install of the wheel failed:\n{pip.stderr[-3000:]}"
    workdir = root / "elsewhere"
    workdir.mkdir()
    return Installed(wheel, venv, workdir)


def test_the_wheel_holds_one_top_level_name_kvgate_and_its_dist_info(installed: Installed) -> None:
    version = version_in_source()
    with zipfile.ZipFile(installed.wheel) as wheel:
        tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert tops == {"kvgate", f"kvgate-{version}.dist-info"}
    assert installed.wheel.name == f"kvgate-{version}-py3-none-any.whl"


def test_installing_it_adds_no_other_top_level_name_to_site_packages(installed: Installed) -> None:
    # RECORD lists every file pip installed for the distribution, relative to site-packages; the
    # console script lands in bin/ (outside site-packages, as "../../../bin/kvgate").
    [record] = installed.venv.glob("lib/python*/site-packages/kvgate-*.dist-info/RECORD")
    paths = [line.split(",", 1)[0] for line in record.read_text().splitlines() if line]
    in_site_packages = {p.split("/", 1)[0] for p in paths if not p.startswith("../")}
    assert in_site_packages == {"kvgate", record.parent.name}
    assert [p for p in paths if p.startswith("../")] == ["../../../bin/kvgate"]


def test_every_source_file_of_every_part_is_in_the_wheel(installed: Installed) -> None:
    # A new subpackage missing from pyproject's package list would install half a kvgate.
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    expected = {f"kvgate/{p.relative_to(REPO / 'kvgate').as_posix()}" for p in (REPO / "kvgate").rglob("*.py")}
    for folder in SUBSYSTEMS:
        expected |= {f"kvgate/{folder}/{p.relative_to(REPO / folder).as_posix()}" for p in (REPO / folder).rglob("*.py")}
    expected.add("kvgate/router/dashboard_page.html")
    assert sorted(expected - names) == []


def test_the_gateway_install_has_no_torch(installed: Installed) -> None:
    probe = installed.run(installed.bin("python"), "-c", "import importlib.util as u; print(u.find_spec('torch'))")
    assert probe.stdout.strip() == "None"


def test_kvgate_version_prints_the_one_version(installed: Installed) -> None:
    answer = installed.run(installed.bin("kvgate"), "--version")
    assert answer.returncode == 0 and answer.stdout.strip() == f"kvgate {version_in_source()}"


def test_the_installed_registry_tooling_validates_the_demo_registry(installed: Installed) -> None:
    answer = installed.run(installed.bin("kvgate"), "registry", "validate", str(REPO / "examples" / "registry"))
    assert answer.returncode == 0, answer.stderr


def test_the_installed_gateway_serves_without_torch(installed: Installed, tmp_path: Path) -> None:
    port = free_loopback_port()
    command = [installed.bin("kvgate"), "router", "--registry", str(REPO / "examples" / "registry"), "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with running(command, name="the installed gateway", ready=lambda: http_answers(base + "/health"),
                 timeout_s=60, log_path=tmp_path / "router.log"):
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as answer:
            assert b"smollm2-135m" in answer.read()
        dashboard = urllib.request.urlopen(base + "/dashboard", timeout=10)  # package data shipped in the wheel
        assert dashboard.status == 200 and b"<html" in dashboard.read().lower()


def test_the_engine_without_torch_says_what_to_install(installed: Installed) -> None:
    answer = installed.run(installed.bin("kvgate"), "engine", "--model", "builtin:tiny-llama", "--port", "1")
    assert answer.returncode == 2
    assert "pip install 'kvgate[engine]'" in answer.stderr and "Traceback" not in answer.stderr
