"""Load a Hugging Face safetensors checkpoint (one file or shards listed in model.safetensors.index.json)
into a LlamaModel, converting to the model's dtype and device tensor by tensor.

HF names map onto our fused parameters: q/k/v_proj fill row ranges of qkv_proj, gate/up_proj of
gate_up_proj. Every expected tensor must be present with its exact shape; a tensor we do not know is an
error too (it usually means the config does not describe the checkpoint), except rotary `inv_freq`
buffers, which we recompute.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvgate.engine.config import ModelConfig, ModelLoadError
from kvgate.engine.runner.model import LlamaModel

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [row_start, row_start + shape[0]) of `tensor`."""

    tensor: torch.Tensor
    row_start: int
    shape: tuple[int, ...]


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    """Fill every weight of `model` from the checkpoint in `model_dir` (before `model.prepare`).
    Raises ModelLoadError naming the file and tensor for a missing, unexpected or wrongly shaped tensor,
    or an unreadable file."""
    model_dir = Path(model_dir)
    targets = expected_tensors(model)
    loaded: set[str] = set()
    for path, name, read in _checkpoint_tensors(model_dir):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target = targets.get(name)
        if target is None:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            raise ModelLoadError(f"{path}: unexpected tensor '{name}'; the config "
                                 f"({model.config.architecture}) has no such weight")
        tensor = read()
        if tuple(tensor.shape) != target.shape:
            raise ModelLoadError(f"{path}: tensor '{name}' has shape {list(tensor.shape)}; "
                                 f"expected {list(target.shape)}")
        rows = target.tensor[target.row_start:target.row_start + target.shape[0]]
        rows.copy_(tensor)  # converts dtype and moves to the model's device
        loaded.add(name)
    missing = [name for name in targets if name not in loaded]  # in model order: layer 2 before layer 10
    if missing:
        files = _checkpoint_files(model_dir)
        where = model_dir / INDEX_FILE if (model_dir / INDEX_FILE).is_file() else ", ".join(map(str, files))
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{where}: missing tensor '{missing[0]}'{more}")


def expected_tensors(model: LlamaModel) -> dict[str, Target]:
    """HF tensor name -> where it lands in our tensors."""
    config: ModelConfig = model.config
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    targets = {
        "model.embed_tokens.weight": _whole(model.embed_tokens),
        "model.norm.weight": _whole(model.norm.weight),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = _whole(model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        # (HF module, our fused Linear, first row, rows)
        pieces = [
            ("self_attn.q_proj", layer.qkv_proj, 0, q),
            ("self_attn.k_proj", layer.qkv_proj, q, kv),
            ("self_attn.v_proj", layer.qkv_proj, q + kv, kv),
            ("self_attn.o_proj", layer.o_proj, 0, config.hidden_size),
            ("mlp.gate_proj", layer.gate_up_proj, 0, inter),
            ("mlp.up_proj", layer.gate_up_proj, inter, inter),
            ("mlp.down_proj", layer.down_proj, 0, config.hidden_size),
        ]
        for name, linear, start, rows in pieces:
            targets[f"{prefix}{name}.weight"] = Target(linear.weight, start, (rows, linear.weight.shape[1]))
            if linear.bias is not None:
                targets[f"{prefix}{name}.bias"] = Target(linear.bias, start, (rows,))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{prefix}{norm}.weight"] = _whole(getattr(layer, norm).weight)
    return targets


def _whole(tensor: torch.Tensor) -> Target:
    return Target(tensor, 0, tuple(tensor.shape))


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index (needs a 'weight_map' object): {exc}") from exc
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: key 'weight_map' must be an object of tensor -> file")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{index}: lists shard '{path.name}', which is not in {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{model_dir}: no model.safetensors, {INDEX_FILE} or *.safetensors file found")


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[Path, str, Callable[[], torch.Tensor]]]:
    """(file, tensor name, reader) for every tensor of every checkpoint file; tensors are read lazily."""
    for path in _checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield path, name, lambda handle=handle, name=name: handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors file: {exc}") from exc
