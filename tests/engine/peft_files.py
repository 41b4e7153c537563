"""PEFT adapter directories written in plain Python (no torch): adapter_config.json plus a safetensors file
of zeros with the shapes asked for, for tests of validation and slot bookkeeping that never read values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvgate.engine.config import ModelConfig, parse_model_config
from kvgate.engine.lora.peft import projection_shape

# hidden 64, 4 heads of 16 (2 KV heads: k/v project to 32), MLP 128, 2 layers.
TINY = parse_model_config({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
})


def lora_key(layer: int, module: str, which: str) -> str:
    parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


def lora_shapes(model: ModelConfig, rank: int, modules: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for layer in range(model.num_hidden_layers):
        for module in modules:
            in_features, out_features = projection_shape(model, module)
            shapes[lora_key(layer, module, "A")] = (rank, in_features)
            shapes[lora_key(layer, module, "B")] = (out_features, rank)
    return shapes


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "F32") -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 4
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(offset))


def write_peft_dir(directory: Path, *, rank: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj"),
                   model: ModelConfig = TINY, shapes: dict[str, tuple[int, ...]] | None = None,
                   **config: Any) -> Path:
    """An adapter directory; `config` overrides adapter_config.json keys (None removes one)."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
           "bias": "none", "use_rslora": False, **config}
    raw = {key: value for key, value in raw.items() if value is not None}
    (directory / "adapter_config.json").write_text(json.dumps(raw))
    write_safetensors(directory / "adapter_model.safetensors",
                      lora_shapes(model, rank, modules) if shapes is None else shapes)
    return directory
