"""The `kvgate registry` command as a user runs it: real processes, exit codes, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema

from tests.registry.samples import MODEL, POOL

REPO = Path(__file__).resolve().parents[2]
KVGATE = [sys.executable, "-m", "kvgate.cli"]


def kvgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVGATE, *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


def test_validate_the_examples() -> None:
    result = kvgate("registry", "validate", "examples/registry", "examples/fleet")
    assert result.returncode == 0, result.stderr
    assert "examples/registry: valid (2 Models, 2 Adapters, 1 Pool, 0 Tenants); version " in result.stdout
    assert "examples/fleet: valid (2 Models, 3 Adapters, 2 Pools, 2 Tenants); version " in result.stdout


def test_validate_lists_every_problem_and_exits_1_without_traceback(write_registry) -> None:
    root = write_registry({
        "pools.yaml": POOL,
        "models.yaml": MODEL + "  engine: {block_size_tokens: big}\n  scaling: {min_replicas: 3, max_replicas: 1}\n"
                       "  colour: blue\n",
        "adapters.yaml": "apiVersion: kvgate/v1\nkind: Adapter\nmetadata: {name: a}\n"
                         "spec: {base_model: ghost, source: /a, rank: 8}\n",
    })
    result = kvgate("registry", "validate", str(root))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: 4 problems in {root}:"
    assert [line.split(": ")[2] for line in lines[1:]] == [
        "spec.base_model", "spec.engine.block_size_tokens", "spec.scaling.min_replicas", "spec.colour"]
    assert all(line.startswith(f"{root}/") and line.split(":")[1].isdigit() for line in lines[1:])


def test_plan_prints_a_readable_diff() -> None:
    result = kvgate("registry", "plan", "examples/registry", "examples/fleet", "--color", "never")
    assert result.returncode == 0, result.stderr
    assert "  + Model/llama-3.1-8b-instruct" in result.stdout
    assert "  - Model/tiny-llama" in result.stdout
    assert result.stdout.rstrip().endswith("Plan: 9 to add, 0 to change, 5 to remove.")


def test_plan_detailed_exit_code_and_json() -> None:
    same = kvgate("registry", "plan", "examples/fleet", "examples/fleet", "--detailed-exitcode")
    assert same.returncode == 0 and "No changes" in same.stdout
    changed = kvgate("registry", "plan", "examples/registry", "--detailed-exitcode", "--json")
    assert changed.returncode == 2
    assert json.loads(changed.stdout)["summary"] == {"add": 5, "change": 0, "remove": 0}


def test_plan_of_an_invalid_registry_exits_1(tmp_path: Path) -> None:
    result = kvgate("registry", "plan", "examples/registry", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert f"{tmp_path / 'missing'}: does not exist" in result.stderr


def test_schema_is_valid_json_schema(tmp_path: Path) -> None:
    result = kvgate("registry", "schema")
    assert result.returncode == 0
    jsonschema.Draft202012Validator.check_schema(json.loads(result.stdout))
    out = tmp_path / "schema.json"
    assert kvgate("registry", "schema", "-o", str(out)).returncode == 0
    assert json.loads(out.read_text()) == json.loads(result.stdout)


def test_python_m_registry_is_the_same_tool() -> None:
    result = subprocess.run([sys.executable, "-m", "kvgate.registry", "validate", "examples/registry"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "valid" in result.stdout


def test_usage_errors_explain_themselves() -> None:
    result = kvgate("registry", "frobnicate")
    assert result.returncode == 2
    assert "invalid choice: 'frobnicate'" in result.stderr and "Traceback" not in result.stderr
