"""Write the demo registry's two LoRA adapters for builtin:smollm2-135m (run by `make run`).

    python examples/registry/demo_adapters.py [OUT_DIR]     (default: .kvgate/demo-adapters)

They are not trained: rank-8 q_proj/v_proj adapters with small seeded random weights, in the PEFT
layout the engine loads (adapter_config.json, adapter_model.safetensors). They exist so that adapter
routing has something to show: requests naming `smollm2-demo-a` go to a replica with that adapter
loaded, and the answer differs a little from the base model's. Deterministic: the same seed gives the
same bytes on every machine (Python's `random` is specified to), so a rerun rewrites nothing.

Plain Python with no imports of ours or of torch, so it runs before anything else is set up.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from pathlib import Path

# SmolLM2-135M-Instruct's shape (its config.json): hidden 576, 30 layers, 9 query heads and 3 KV heads of
# 64 dims, so q_proj is 576 -> 576 and v_proj 576 -> 192.
HIDDEN = 576
NUM_LAYERS = 30
KV_SIZE = 3 * 64
RANK = 8
ALPHA = 16  # scale alpha / rank = 2
# Weights uniform in +-0.05: the update B @ A x 2 has entries of about 0.005, a few per cent of the base
# projections' weights: the answers change, they stay fluent.
SPREAD = 0.05
ADAPTERS = {"smollm2-demo-a": 1, "smollm2-demo-b": 2}  # name -> seed
DEFAULT_OUT = Path(".kvgate/demo-adapters")


def tensor_shapes() -> dict[str, tuple[int, int]]:
    """PEFT tensor names -> shapes: lora_A is (rank, in), lora_B is (out, rank)."""
    shapes = {}
    for layer in range(NUM_LAYERS):
        for module, out_features in (("q_proj", HIDDEN), ("v_proj", KV_SIZE)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{prefix}.lora_A.weight"] = (RANK, HIDDEN)
            shapes[f"{prefix}.lora_B.weight"] = (out_features, RANK)
    return shapes


def safetensors_bytes(seed: int) -> bytes:
    """A safetensors file (8-byte header length, JSON header, little-endian float32 data)."""
    rng = random.Random(seed)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks = []
    offset = 0
    for name, (rows, cols) in tensor_shapes().items():
        count = rows * cols
        chunks.append(struct.pack(f"<{count}f", *(rng.uniform(-SPREAD, SPREAD) for _ in range(count))))
        header[name] = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [offset, offset + 4 * count]}
        offset += 4 * count
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    return len(blob).to_bytes(8, "little") + blob + b"".join(chunks)


def adapter_config() -> bytes:
    return json.dumps({"peft_type": "LORA", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                       "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
                       "lora_dropout": 0.0, "bias": "none", "use_rslora": False}, indent=2).encode() + b"\n"


def _write_if_changed(path: Path, data: bytes) -> bool:
    if path.is_file() and path.read_bytes() == data:
        return False
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    temporary.replace(path)  # atomic: an engine starting meanwhile reads the old file or the new one
    return True


def write_adapters(out_dir: Path) -> dict[str, str]:
    """Write every demo adapter under `out_dir`; returns name -> sha256 of its weights file."""
    digests = {}
    for name, seed in ADAPTERS.items():
        directory = out_dir / name
        directory.mkdir(parents=True, exist_ok=True)
        weights = safetensors_bytes(seed)
        changed = _write_if_changed(directory / "adapter_config.json", adapter_config())
        changed |= _write_if_changed(directory / "adapter_model.safetensors", weights)
        digests[name] = hashlib.sha256(weights).hexdigest()
        print(f"demo adapter {name}: {directory} ({'written' if changed else 'up to date'}, "
              f"weights sha256 {digests[name][:12]})")
    return digests


if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        raise SystemExit(2)
    write_adapters(Path(sys.argv[1]) if len(sys.argv) == 2 else DEFAULT_OUT)
