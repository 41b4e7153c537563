"""Validation of PEFT adapter directories against the base model, in plain Python: what is accepted, the
scale each config implies, and errors that name the file, the key or tensor, the value and what is allowed.

Base model (peft_files.TINY): hidden 64, q 64, k/v 32, MLP 128, 2 layers. max_lora_rank 16.
"""

from __future__ import annotations

import math

import pytest

from kvgate.engine.lora import AdapterLoadError
from kvgate.engine.lora.peft import read_peft_adapter
from tests.engine.peft_files import TINY, lora_key, lora_shapes, write_peft_dir, write_safetensors

MAX_RANK = 16


def test_a_valid_adapter_lists_its_pairs_by_layer_then_module(tmp_path) -> None:
    adapter = read_peft_adapter(write_peft_dir(tmp_path, rank=8, modules=("v_proj", "q_proj", "down_proj")),
                                TINY, MAX_RANK)

    assert adapter.rank == 8 and adapter.alpha == 16.0 and adapter.scale == 2.0  # alpha / r
    assert adapter.target_modules == ("q_proj", "v_proj", "down_proj")
    assert [(p.layer, p.module) for p in adapter.pairs] == [
        (0, "q_proj"), (0, "v_proj"), (0, "down_proj"), (1, "q_proj"), (1, "v_proj"), (1, "down_proj")]
    assert adapter.pairs[0].a_name == lora_key(0, "q_proj", "A")


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tmp_path) -> None:
    adapter = read_peft_adapter(write_peft_dir(tmp_path, rank=4, lora_alpha=6, use_rslora=True), TINY, MAX_RANK)
    assert adapter.scale == 6 / math.sqrt(4)  # 3.0, where plain LoRA would give 1.5


def test_alpha_defaults_to_peft_default_of_8(tmp_path) -> None:
    assert read_peft_adapter(write_peft_dir(tmp_path, rank=4, lora_alpha=None), TINY, MAX_RANK).scale == 2.0


def test_a_pattern_for_target_modules_defers_to_the_tensors(tmp_path) -> None:
    directory = write_peft_dir(tmp_path, modules=("o_proj", "up_proj"), target_modules="all-linear")
    assert read_peft_adapter(directory, TINY, MAX_RANK).target_modules == ("o_proj", "up_proj")


def test_only_some_layers_may_be_adapted(tmp_path) -> None:
    shapes = {k: v for k, v in lora_shapes(TINY, 4, ("q_proj",)).items() if ".layers.1." in k}
    adapter = read_peft_adapter(write_peft_dir(tmp_path, modules=("q_proj",), shapes=shapes), TINY, MAX_RANK)
    assert [(p.layer, p.module) for p in adapter.pairs] == [(1, "q_proj")]


@pytest.mark.parametrize("case, message", [
    ("missing dir", "not a directory"),
    ("missing config", "adapter_config.json: not found"),
    ("missing weights", "adapter_model.safetensors: not found"),
    ("rank too large", "key 'r' is 32, above this engine's max_lora_rank 16; raise it (kvgate engine --max-lora-rank"),
    ("rank zero", "key 'r' must be a positive integer; got 0"),
    ("negative alpha", "key 'lora_alpha' must be a positive number; got -1"),
    ("unsupported module", "lists unsupported module(s) embed_tokens; supported: q_proj"),
    ("dora", "key 'use_dora' is True; DoRA adapters are not supported"),
    ("bias", "key 'bias' must be 'none'"),
    ("rank pattern", "per-module ranks (rank_pattern) are not supported"),
    ("not lora", "key 'peft_type' must be 'LORA'; got 'IA3'"),
    ("config not json", "adapter_config.json: not valid JSON"),
])
def test_bad_configs_are_refused_with_a_message_naming_the_problem(tmp_path, case: str, message: str) -> None:
    directory = tmp_path / "adapter"
    overrides = {
        "rank too large": {"rank": 32}, "rank zero": {"r": 0}, "negative alpha": {"lora_alpha": -1},
        "unsupported module": {"target_modules": ["q_proj", "embed_tokens"]}, "dora": {"use_dora": True},
        "bias": {"bias": "lora_only"}, "rank pattern": {"rank_pattern": {"q_proj": 8}},
        "not lora": {"peft_type": "IA3"},
    }.get(case, {})
    if case != "missing dir":
        write_peft_dir(directory, **overrides)
    if case == "missing config":
        (directory / "adapter_config.json").unlink()
    if case == "missing weights":
        (directory / "adapter_model.safetensors").unlink()
    if case == "config not json":
        (directory / "adapter_config.json").write_text("{r: 4")

    with pytest.raises(AdapterLoadError) as error:
        read_peft_adapter(directory, TINY, MAX_RANK)
    assert message in str(error.value)


def test_a_tensor_of_the_wrong_shape_names_the_tensor_and_both_shapes(tmp_path) -> None:
    shapes = lora_shapes(TINY, 4, ("q_proj", "v_proj"))
    shapes[lora_key(1, "v_proj", "B")] = (64, 4)  # v projects to 32 (2 KV heads of 16), not 64
    with pytest.raises(AdapterLoadError, match=r"tensor 'base_model\.model\.model\.layers\.1\.self_attn\.v_proj"
                                               r"\.lora_B\.weight' has shape \[64, 4\]; the base model's v_proj "
                                               r"at rank 4 needs \[32, 4\]"):
        read_peft_adapter(write_peft_dir(tmp_path, shapes=shapes), TINY, MAX_RANK)


def test_an_adapter_for_a_bigger_model_is_refused(tmp_path) -> None:
    with pytest.raises(AdapterLoadError, match="is for layer 2; the base model has 2 layers"):
        read_peft_adapter(write_peft_dir(tmp_path, shapes=lora_shapes(TINY, 4, ("q_proj",)) | {
            lora_key(2, "q_proj", "A"): (4, 64), lora_key(2, "q_proj", "B"): (64, 4)}, modules=("q_proj",)),
            TINY, MAX_RANK)


def test_a_lone_lora_a_without_its_b_is_refused(tmp_path) -> None:
    shapes = lora_shapes(TINY, 4, ("q_proj",))
    del shapes[lora_key(0, "q_proj", "B")]
    with pytest.raises(AdapterLoadError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight' has no matching "
                                               r"lora_B tensor"):
        read_peft_adapter(write_peft_dir(tmp_path, modules=("q_proj",), shapes=shapes), TINY, MAX_RANK)


def test_a_tensor_of_a_module_the_config_does_not_list_is_refused(tmp_path) -> None:
    directory = write_peft_dir(tmp_path, modules=("q_proj", "o_proj"), target_modules=["q_proj"])
    with pytest.raises(AdapterLoadError, match="targets 'o_proj', which target_modules in adapter_config.json "
                                               "does not list"):
        read_peft_adapter(directory, TINY, MAX_RANK)


def test_unknown_tensors_and_truncated_files_are_refused(tmp_path) -> None:
    directory = write_peft_dir(tmp_path / "extra", shapes={**lora_shapes(TINY, 4, ("q_proj", "v_proj")),
                                                          "base_model.model.lm_head.weight": (256, 64)})
    with pytest.raises(AdapterLoadError, match="unexpected tensor 'base_model.model.lm_head.weight'"):
        read_peft_adapter(directory, TINY, MAX_RANK)

    directory = write_peft_dir(tmp_path / "truncated")
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(AdapterLoadError, match="lies outside the file .* truncated or corrupt"):
        read_peft_adapter(directory, TINY, MAX_RANK)

    (directory / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(AdapterLoadError, match="not a safetensors file"):
        read_peft_adapter(directory, TINY, MAX_RANK)


def test_an_unsupported_dtype_is_refused(tmp_path) -> None:
    directory = write_peft_dir(tmp_path)
    write_safetensors(directory / "adapter_model.safetensors", lora_shapes(TINY, 4, ("q_proj", "v_proj")), "I64")
    with pytest.raises(AdapterLoadError, match="has dtype I64; allowed: F32, F16, BF16, F64"):
        read_peft_adapter(directory, TINY, MAX_RANK)
