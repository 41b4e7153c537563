"""Read and validate a LoRA adapter saved in Hugging Face PEFT format, in plain Python (no torch):

    <dir>/adapter_config.json        {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                      "target_modules": ["q_proj", "v_proj"], "use_rslora": false, ...}
    <dir>/adapter_model.safetensors  base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight [r, in]
                                     base_model.model.model.layers.<i>.self_attn.q_proj.lora_B.weight [out, r]

A target module's output becomes W x + scale * B (A x), with scale = lora_alpha / r, or
lora_alpha / sqrt(r) under rsLoRA (use_rslora). Only the tensors' names, dtypes and shapes are read here,
from the safetensors header (8-byte length, then JSON), so an adapter is checked against the base model in
milliseconds; engine/runner/lora.py reads the values when it loads the adapter into a slot.

Supported: the seven Llama projections, one rank and one alpha for the whole adapter, any subset of layers.
Refused with a message: DoRA, trained biases, fan_in_fan_out, per-module rank or alpha patterns,
modules_to_save, and any tensor that is not a lora_A/lora_B weight of a supported projection.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.engine.config import ModelConfig
from kvgate.engine.lora.errors import AdapterLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# module -> the submodule of a decoder layer that holds it, in HF Llama naming.
SUPPORTED_MODULES = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
SAFETENSORS_DTYPES = ("F32", "F16", "BF16", "F64")
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# Options that change what the tensors mean; an adapter that sets one is refused rather than served wrong.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
    "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained extra modules (modules_to_save)", "lora_bias": "LoRA biases (lora_bias)",
}


@dataclass(frozen=True)
class LoraPair:
    """The two tensors of one adapted projection: lora_A [rank, in] and lora_B [out, rank]."""

    layer: int
    module: str  # one of SUPPORTED_MODULES
    a_name: str
    b_name: str


@dataclass(frozen=True)
class PeftAdapter:
    """A validated adapter directory: its files fit the base model and max_lora_rank."""

    directory: Path
    rank: int
    alpha: float
    scale: float  # what B (A x) is multiplied by
    target_modules: tuple[str, ...]  # modules with tensors, in SUPPORTED_MODULES order
    pairs: tuple[LoraPair, ...]  # by layer, then module

    @property
    def weights_path(self) -> Path:
        return self.directory / WEIGHTS_FILE


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one projection of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size), "k_proj": (hidden, config.kv_size), "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def read_peft_adapter(directory: str | Path, model: ModelConfig, max_rank: int) -> PeftAdapter:
    """Validate `directory` against the base model. Raises AdapterLoadError naming the file, the key or
    tensor, the bad value and what is allowed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterLoadError(f"{directory}: not a directory; an adapter is a directory with "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    config_path = directory / CONFIG_FILE
    raw = _read_config(config_path)
    rank, alpha, scale, listed = _parse_config(raw, config_path, max_rank)
    weights_path = directory / WEIGHTS_FILE
    header = read_safetensors_header(weights_path)
    pairs = _pairs(header, weights_path, model, rank, listed)
    modules = {pair.module for pair in pairs}
    return PeftAdapter(directory=directory, rank=rank, alpha=alpha, scale=scale,
                       target_modules=tuple(m for m in SUPPORTED_MODULES if m in modules), pairs=pairs)


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (safetensors dtype, shape), checking that every tensor's bytes lie in the file."""
    if not path.is_file():
        raise AdapterLoadError(f"{path}: not found; PEFT adapters keep their weights in {WEIGHTS_FILE} "
                               f"(adapter_model.bin is not supported)")
    try:
        file_size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= min(_MAX_HEADER_BYTES, file_size - 8):
                raise AdapterLoadError(f"{path}: not a safetensors file (bad header length {length})")
            header = json.loads(handle.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(f"{path}: cannot read the safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterLoadError(f"{path}: not a safetensors file (the header is not a JSON object)")
    data_size = file_size - 8 - length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise AdapterLoadError(f"{path}: tensor '{name}' has a malformed header entry: {info!r}") from exc
        if not 0 <= start <= end <= data_size:
            raise AdapterLoadError(f"{path}: tensor '{name}' lies outside the file (bytes {start}..{end} of "
                                   f"{data_size}); the file is truncated or corrupt")
        tensors[name] = (dtype, shape)
    return tensors


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise AdapterLoadError(f"{path}: not found; a PEFT adapter directory needs {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise AdapterLoadError(f"{path}: expected a JSON object; got {type(raw).__name__}")
    return raw


def _parse_config(raw: dict[str, Any], path: Path, max_rank: int) -> tuple[int, float, float, frozenset[str] | None]:
    """(rank, alpha, scale, the target modules listed, or None when the config gives a pattern)."""
    def fail(key: str, allowed: str) -> AdapterLoadError:
        return AdapterLoadError(f"{path}: key '{key}' must be {allowed}; got {raw.get(key)!r}")

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail("peft_type", "'LORA'")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail("r", "a positive integer")
    if rank > max_rank:
        raise AdapterLoadError(f"{path}: key 'r' is {rank}, above this engine's max_lora_rank {max_rank}; "
                               f"raise it (kvgate engine --max-lora-rank; a registry Model's "
                               f"spec.engine.max_adapter_rank) or use an adapter of rank <= {max_rank}")
    alpha = raw.get("lora_alpha", 8)  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise fail("lora_alpha", "a positive number")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise fail("use_rslora", "true or false")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if raw.get(key):
            raise AdapterLoadError(f"{path}: key '{key}' is {raw[key]!r}; {what} are not supported")
    if raw.get("bias", "none") != "none":
        raise fail("bias", "'none' (adapters with trained biases are not supported)")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return rank, float(alpha), scale, _listed_modules(raw.get("target_modules"), path)


def _listed_modules(value: Any, path: Path) -> frozenset[str] | None:
    if value is None or isinstance(value, str):
        return None  # a regex or "all-linear": the tensors say which modules are adapted
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterLoadError(f"{path}: key 'target_modules' must be a list of module names or a string; "
                               f"got {value!r}")
    modules = frozenset(name.rsplit(".", 1)[-1] for name in value)  # "self_attn.q_proj" names q_proj
    unsupported = sorted(modules - SUPPORTED_MODULES.keys())
    if unsupported:
        raise AdapterLoadError(f"{path}: key 'target_modules' lists unsupported module(s) "
                               f"{', '.join(unsupported)}; supported: {', '.join(SUPPORTED_MODULES)}")
    return modules


def _pairs(header: dict[str, tuple[str, tuple[int, ...]]], path: Path, model: ModelConfig, rank: int,
           listed: frozenset[str] | None) -> tuple[LoraPair, ...]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, (dtype, shape) in header.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise AdapterLoadError(f"{path}: unexpected tensor '{name}'; expected names like "
                                   f"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if SUPPORTED_MODULES.get(module) != parent:
            raise AdapterLoadError(f"{path}: tensor '{name}' targets unsupported module '{parent}.{module}'; "
                                   f"supported: {', '.join(SUPPORTED_MODULES)}")
        if listed is not None and module not in listed:
            raise AdapterLoadError(f"{path}: tensor '{name}' targets '{module}', which target_modules in "
                                   f"{CONFIG_FILE} does not list")
        if layer >= model.num_hidden_layers:
            raise AdapterLoadError(f"{path}: tensor '{name}' is for layer {layer}; the base model has "
                                   f"{model.num_hidden_layers} layers")
        if dtype not in SAFETENSORS_DTYPES:
            raise AdapterLoadError(f"{path}: tensor '{name}' has dtype {dtype}; "
                                   f"allowed: {', '.join(SAFETENSORS_DTYPES)}")
        in_features, out_features = projection_shape(model, module)
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if shape != expected:
            raise AdapterLoadError(f"{path}: tensor '{name}' has shape {list(shape)}; the base model's {module} "
                                   f"at rank {rank} needs {list(expected)}")
        found.setdefault((layer, module), {})[which] = name
    if not found:
        raise AdapterLoadError(f"{path}: holds no lora_A/lora_B tensors")
    pairs = []
    order = list(SUPPORTED_MODULES)
    for (layer, module), names in sorted(found.items(), key=lambda item: (item[0][0], order.index(item[0][1]))):
        missing = "B" if "B" not in names else "A" if "A" not in names else None
        if missing is not None:
            present = next(iter(names.values()))
            raise AdapterLoadError(f"{path}: tensor '{present}' has no matching lora_{missing} tensor")
        pairs.append(LoraPair(layer, module, names["A"], names["B"]))
    return tuple(pairs)
