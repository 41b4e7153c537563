"""The demo registry that `make run` serves: it validates from a fresh checkout (its two adapters are
built into the engine, nothing has to be generated first), and the built-in adapters are deterministic and
accepted by the engine's own PEFT reader for the real builtin:smollm2-135m (its config.json from the shared
cache), so the demo's replica starts with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.engine.config import parse_model_config
from kvgate.engine.lora import AdapterLoadError
from kvgate.engine.lora.builtin import BASE_MODEL, BUILTIN_ADAPTERS
from kvgate.engine.lora.peft import WEIGHTS_FILE, read_peft_adapter
from kvgate.engine.lora.source import fetch_adapter
from kvgate.registry import load_registry
from kvgate.registry.schema import BUILTIN_ADAPTERS as REGISTRY_BUILTIN_ADAPTERS
from kvgate.stack import missing_adapter_sources
from tests.engine.builtin_cache import smollm2_dir

REPO = Path(__file__).resolve().parents[2]


def test_builtin_adapters_are_deterministic_and_fit_smollm2(tmp_path: Path) -> None:
    names = ["smollm2-demo-a", "smollm2-demo-b"]
    first = {n: fetch_adapter(f"builtin:{n}", tmp_path / "one") for n in names}
    second = {n: fetch_adapter(f"builtin:{n}", tmp_path / "two") for n in names}
    written = first["smollm2-demo-a"].joinpath(WEIGHTS_FILE).stat().st_mtime_ns
    assert fetch_adapter("builtin:smollm2-demo-a", tmp_path / "one") == first["smollm2-demo-a"]
    assert first["smollm2-demo-a"].joinpath(WEIGHTS_FILE).stat().st_mtime_ns == written  # built once, then reused
    weights = {n: (first[n] / WEIGHTS_FILE).read_bytes() for n in names}
    assert all(weights[n] == (second[n] / WEIGHTS_FILE).read_bytes() for n in names)  # the same on every machine
    assert weights["smollm2-demo-a"] != weights["smollm2-demo-b"]  # two adapters, two answers

    model = parse_model_config(json.loads((smollm2_dir() / "config.json").read_text()))
    for name in names:
        assert read_peft_adapter(first[name], model, max_rank=16).rank == 8


def test_an_unknown_builtin_adapter_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(AdapterLoadError, match="built-ins are builtin:smollm2-demo-a, builtin:smollm2-demo-b"):
        fetch_adapter("builtin:smollm2-demo-z", tmp_path)


def test_the_registry_knows_the_engines_builtin_adapters() -> None:
    assert REGISTRY_BUILTIN_ADAPTERS == {name: BASE_MODEL.removeprefix("builtin:") for name in BUILTIN_ADAPTERS}


def test_the_demo_registry_validates_and_needs_nothing_generated_first(tmp_path: Path) -> None:
    snapshot = load_registry(REPO / "examples" / "registry")
    assert sorted(snapshot.models) == ["smollm2-135m", "tiny-llama"]
    assert {a.spec.base_model for a in snapshot.adapters.values()} == {"smollm2-135m"}
    assert missing_adapter_sources(snapshot, tmp_path) == []  # `kvgate up` from an empty directory starts
