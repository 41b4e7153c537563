"""The demo registry that `make run` serves: it validates, its adapters are written deterministically by
`examples/registry/demo_adapters.py`, and the engine's own PEFT reader accepts them for the real
builtin:smollm2-135m (its config.json from the shared cache), so the demo's replica starts with them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvgate.engine.config import parse_model_config
from kvgate.engine.lora.peft import read_peft_adapter
from kvgate.stack import missing_adapter_sources
from kvgate.registry import load_registry
from tests.engine.builtin_cache import smollm2_dir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "registry" / "demo_adapters.py"


def write(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=60,
                          check=True)


def test_demo_adapters_are_deterministic_and_fit_smollm2(tmp_path: Path) -> None:
    first = write(tmp_path / "one")
    write(tmp_path / "two")
    again = write(tmp_path / "one")
    assert "written" in first.stdout and again.stdout.count("up to date") == 2  # a rerun rewrites nothing
    names = ["smollm2-demo-a", "smollm2-demo-b"]
    weights = {n: (tmp_path / "one" / n / "adapter_model.safetensors").read_bytes() for n in names}
    for name in names:
        assert weights[name] == (tmp_path / "two" / name / "adapter_model.safetensors").read_bytes()
    assert weights["smollm2-demo-a"] != weights["smollm2-demo-b"]  # two adapters, two answers

    model = parse_model_config(json.loads((smollm2_dir() / "config.json").read_text()))
    for name in names:
        adapter = read_peft_adapter(tmp_path / "one" / name, model, max_rank=16)
        assert adapter.rank == 8


def test_the_demo_registry_validates_and_names_the_adapters_make_run_writes(tmp_path: Path) -> None:
    snapshot = load_registry(REPO / "examples" / "registry")
    assert sorted(snapshot.models) == ["smollm2-135m", "tiny-llama"]
    assert {a.spec.base_model for a in snapshot.adapters.values()} == {"smollm2-135m"}
    assert len(missing_adapter_sources(snapshot, tmp_path)) == 2  # not written in an empty directory ...
    write(tmp_path / ".kvgate" / "demo-adapters")  # ... and found once `make run`'s step wrote them there
    assert missing_adapter_sources(snapshot, tmp_path) == []
