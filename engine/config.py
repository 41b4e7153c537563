"""A model's architecture, parsed once from its Hugging Face `config.json` into a frozen value.

Plain Python (no torch): the scheduler and the server read the limits (max length, EOS ids) without
importing the runner. Supported: Llama-family decoders (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM): RMSNorm, rotary embeddings (plain, linear or Llama-3 scaled), grouped-query
attention and a SwiGLU MLP.

Both spellings of the rotary settings are read: the classic top-level `rope_theta` + `rope_scaling`
({"type"|"rope_type": ...}), and transformers 5's `rope_parameters` ({"rope_type", "rope_theta", ...}).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """A model directory cannot be served: its config or weights are missing, unsupported or malformed.
    The message names the file and the key, the bad value and what is allowed."""


# Architecture name -> (q/k/v projections have a bias, o_proj has a bias). Llama and Mistral read their
# biases from the config's `attention_bias`; Qwen2 always has q/k/v biases and never an o_proj bias.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_SCALING_TYPES = ("llama3", "linear")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for contexts beyond the pre-training length.

    llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those shorter than original / high_freq_factor are kept, and those between are blended.
    linear: every frequency is divided by `factor` (positions are compressed `factor` times).
    """

    rope_type: str  # one of ROPE_SCALING_TYPES
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json allows one id or a list; () when absent
    torch_dtype: str | None  # the checkpoint's dtype name ("bfloat16", ...), None when not stated
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral; attention is exact while sequences stay within it

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) this engine computes exactly. A sliding window shorter
        than the position limit caps it, since the runner attends to the full context."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `<model_dir>/config.json`. Raises ModelLoadError naming the file and the key."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: not found; a model directory needs a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object at the top level; got {type(raw).__name__}")
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Validate a parsed config.json; `source` names the file in error messages."""
    fields = _Fields(raw, source)
    architecture = _architecture(fields)
    hidden_size = fields.positive_int("hidden_size")
    num_heads = fields.positive_int("num_attention_heads")
    num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{source}: key 'num_key_value_heads' must divide num_attention_heads "
                             f"({num_heads}); got {num_kv_heads}")
    if fields.get("head_dim") is None and hidden_size % num_heads:
        raise ModelLoadError(f"{source}: key 'hidden_size' ({hidden_size}) is not a multiple of "
                             f"num_attention_heads ({num_heads}) and no 'head_dim' is given")
    head_dim = fields.positive_int("head_dim", default=hidden_size // num_heads)
    if head_dim % 2:
        raise ModelLoadError(f"{source}: key 'head_dim' must be even for rotary embeddings; got {head_dim}")
    rope_theta, rope_scaling = _rope(fields)
    act = fields.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: key 'hidden_act' must be 'silu'; got {act!r}")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = fields.boolean("attention_bias", default=False)
    return ModelConfig(
        architecture=architecture,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_hidden_layers=fields.positive_int("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.positive_float("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=fields.positive_int("max_position_embeddings", default=2048),
        tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
        bos_token_id=fields.optional_token_id("bos_token_id"),
        eos_token_ids=_eos_ids(fields),
        torch_dtype=_dtype_name(fields),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=fields.boolean("mlp_bias", default=False),
        sliding_window=_sliding_window(fields, is_qwen2),
    )


class _Fields:
    """Typed reads of config.json keys with errors that name the file, the key and the bad value."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def fail(self, key: str, value: Any, allowed: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: key '{key}' must be {allowed}; got {value!r}")

    def required(self, key: str, default: Any) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is None:
            raise ModelLoadError(f"{self.source}: missing required key '{key}'")
        return default

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.required(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(key, value, "a positive integer")
        return value

    def positive_float(self, key: str, default: float | None = None, raw: Any = None) -> float:
        value = self.required(key, default) if raw is None else raw
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.fail(key, value, "a positive number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def optional_token_id(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, value, "a token id (integer >= 0) or null")
        return value


def _architecture(fields: _Fields) -> str:
    archs = fields.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelLoadError(f"{fields.source}: missing required key 'architectures' (a list such as "
                             f"[\"LlamaForCausalLM\"])")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ModelLoadError(f"{fields.source}: key 'architectures' is {archs!r}, which is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(fields: _Fields) -> tuple[float, RopeScaling | None]:
    params = fields.get("rope_parameters")
    if params is not None:  # transformers >= 5: theta and scaling in one dict
        key = "rope_parameters"
        if not isinstance(params, dict):
            raise fields.fail(key, params, "an object")
        theta = fields.positive_float(f"{key}.rope_theta", raw=params.get("rope_theta", 10000.0))
        scaling = params
    else:
        key = "rope_scaling"
        theta = fields.positive_float("rope_theta", default=10000.0)
        scaling = fields.get(key)
        if scaling is None:
            return theta, None
        if not isinstance(scaling, dict):
            raise fields.fail(key, scaling, "an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALING_TYPES:
        raise fields.fail(f"{key}.rope_type", rope_type, f"one of default, {', '.join(ROPE_SCALING_TYPES)}")
    factor = fields.positive_float(f"{key}.factor", raw=scaling.get("factor", 0))
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    low = fields.positive_float(f"{key}.low_freq_factor", raw=scaling.get("low_freq_factor", 0))
    high = fields.positive_float(f"{key}.high_freq_factor", raw=scaling.get("high_freq_factor", 0))
    if high <= low:
        raise fields.fail(f"{key}.high_freq_factor", high, f"greater than low_freq_factor ({low})")
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise fields.fail(f"{key}.original_max_position_embeddings", original, "a positive integer")
    return theta, RopeScaling("llama3", factor, low, high, original)


def _eos_ids(fields: _Fields) -> tuple[int, ...]:
    value = fields.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise fields.fail("eos_token_id", value, "a token id, a list of token ids, or null")
    return tuple(ids)


def _dtype_name(fields: _Fields) -> str | None:
    # transformers >= 5 writes "dtype"; older versions "torch_dtype".
    key = "dtype" if fields.get("dtype") is not None else "torch_dtype"
    value = fields.get(key)
    if value is None:
        return None
    if value not in DTYPES:
        raise fields.fail(key, value, f"one of {', '.join(DTYPES)}")
    return value


def _sliding_window(fields: _Fields, is_qwen2: bool) -> int | None:
    if is_qwen2 and not fields.get("use_sliding_window", False):
        return None  # Qwen2 configs carry a window size that is off unless use_sliding_window is set
    value = fields.get("sliding_window")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fields.fail("sliding_window", value, "a positive integer or null")
    return value
