"""Random LoRA adapters in Hugging Face PEFT format for tests, and the reference they are checked against:
the same HF model with the adapter MERGED into its weights (W + scale * B @ A), run by transformers.

The files are written by hand in the layout PEFT's save_pretrained produces (adapter_config.json and
adapter_model.safetensors with keys base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight),
so the tests need no peft install.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.engine.builtin_cache import tiny_llama_dir
from tests.engine.hf_models import SPECS, build_tiny_model

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTENTION + MLP


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int
    use_rslora: bool = False
    std: float = 0.2  # of lora_A and lora_B; with the tiny models' weights at 0.2, the adapter changes the output

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def tiny_hf_model(directory: Path, spec_name: str = "gqa_tied") -> torch.nn.Module:
    """A tiny random HF Llama (hf_models.SPECS, wide init) saved to `directory` with tiny-llama's tokenizer,
    so the whole engine can load it; returns the HF model."""
    model = build_tiny_model(SPECS[spec_name], directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir() / name, directory / name)
    return model


def _module(model: torch.nn.Module, layer: int, name: str) -> torch.nn.Linear:
    block = model.model.layers[layer]
    return getattr(block.self_attn if name in ATTENTION else block.mlp, name)


def write_adapter(directory: Path, model: torch.nn.Module, spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """Write a random PEFT adapter for `model` into `directory`; returns its tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = {}
    for layer in range(len(model.model.layers)):
        for name in spec.targets:
            out_features, in_features = _module(model, layer, name).weight.shape
            parent = "self_attn" if name in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(spec.rank, in_features, generator=generator) * spec.std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, spec.rank, generator=generator) * spec.std
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny", "r": spec.rank,
              "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": list(spec.targets), "bias": "none",
              "use_rslora": spec.use_rslora, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return tensors


def merged(model: torch.nn.Module, tensors: dict[str, torch.Tensor], spec: AdapterSpec) -> torch.nn.Module:
    """A copy of `model` with the adapter merged into its weights: W + scale * B @ A."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for layer in range(len(out.model.layers)):
            for name in spec.targets:
                parent = "self_attn" if name in ATTENTION else "mlp"
                key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
                delta = spec.scale * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
                _module(out, layer, name).weight += delta
    return out
