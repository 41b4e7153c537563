"""Built-in adapters: two demo LoRA adapters for builtin:smollm2-135m, written into the cache on first use.

    builtin_adapter_dir("smollm2-demo-a", cache)   -> <cache>/adapters/builtin/smollm2-demo-a-v1

They give adapter routing something to show (the demo registry, examples/registry, serves both), so
they are built in as the models are, rather than files a user has to generate before `kvgate up`
starts. They are not trained: rank-8 q_proj/v_proj adapters with small seeded random weights, in the
PEFT layout engine.lora.peft reads. The answer with one differs a little from the base model's.

Deterministic: the same seed gives the same bytes on every machine (Python's `random` is specified
to), so every replica and node builds the same adapter. A directory is written beside its final place
and renamed into place when complete; a concurrent builder that loses the rename drops its copy, so
nobody sees a half-written adapter. The name carries a format version (`-v1`), as builtin models do.
Plain Python (no torch): about 0.3 s per adapter.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import tempfile
from pathlib import Path
from types import MappingProxyType

from kvgate.engine.lora.errors import AdapterLoadError
from kvgate.engine.lora.peft import CONFIG_FILE, WEIGHTS_FILE

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
FORMAT = "v1"
# name -> seed; each is built for builtin:smollm2-135m (registry.schema.BUILTIN_ADAPTERS says so too).
BUILTIN_ADAPTERS: MappingProxyType[str, int] = MappingProxyType({"smollm2-demo-a": 1, "smollm2-demo-b": 2})
BASE_MODEL = "builtin:smollm2-135m"


def builtin_adapter_dir(name: str, cache_dir: Path) -> Path:
    """The PEFT directory of built-in adapter `name`, written under `cache_dir` on first use. Idempotent
    and safe from concurrent processes. Raises AdapterLoadError for an unknown name or a failed write."""
    if name not in BUILTIN_ADAPTERS:
        known = ", ".join(f"builtin:{n}" for n in BUILTIN_ADAPTERS)
        raise AdapterLoadError(f"unknown built-in adapter 'builtin:{name}'; built-ins are {known}")
    root = Path(cache_dir) / "adapters" / "builtin"
    target = root / f"{name}-{FORMAT}"
    if target.is_dir():  # renamed into place only when complete
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            (work / CONFIG_FILE).write_bytes(adapter_config())
            (work / WEIGHTS_FILE).write_bytes(safetensors_bytes(BUILTIN_ADAPTERS[name]))
            work.chmod(0o755)  # mkdtemp made it private; a cache may be shared by several users
            work.rename(target)
        except OSError:
            if not target.is_dir():  # not another process that renamed its copy first
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except OSError as exc:
        raise AdapterLoadError(f"writing built-in adapter builtin:{name} in {root} failed: {exc}") from exc
    return target


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
