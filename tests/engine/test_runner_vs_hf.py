"""The runner against Hugging Face transformers on tiny random checkpoints: same logits, same greedy
tokens, whatever the batching (mixed prefill and decode), the chunking of a prompt, or the sharing of
cached prefix blocks; and loader errors that name the file and the key.

Decodes are attended by the compiled kernel (engine/runner/kernels.py, built by the session fixture) unless
a test asks for attention_kernel="off", which gathers their blocks; the exactness tests run both ways.

Models: hidden 64, 4 heads of 16, vocab 256, 2-3 layers, float32 (hf_models.SPECS): MHA and GQA (2 and 1
KV heads), tied and untied embeddings, llama3 and linear rotary scaling, a sharded checkpoint, Mistral and
Qwen2 (q/k/v biases). Prompts are 1, 7, 16 and 37 tokens: a lone token (attended as a decode), less than a
block, exactly a block, several blocks.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.engine.config import ModelLoadError, parse_model_config
from kvgate.engine.runner.runner import ModelRunner
from kvgate.engine.sequence import ModelInput
from tests.engine.hf_models import (SPECS, NaiveDriver, build_tiny_model, hf_greedy, hf_last_logits, make_runner,
                                    scheduled)

PROMPT_LENGTHS = (1, 7, 16, 37)
ATOL = RTOL = 1e-4


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """name -> (checkpoint dir, HF model), built on first use and shared by the module's tests."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            built[name] = directory, build_tiny_model(SPECS[name], directory)
        return built[name]

    return get


ATTENTION = ("wait", "off")  # the compiled kernel; the gather path


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", list(SPECS))
def test_last_position_logits_match_hf_for_a_batch_of_mixed_length_prompts(tiny, name: str, attention: str) -> None:
    model_dir, hf = tiny(name)
    driver = NaiveDriver(make_runner(model_dir, block_size=16, attention_kernel=attention), blocks_per_seq=4)
    batch = prompts()

    logits = driver.step([driver.chunk(i, p, 0) for i, p in enumerate(batch)])

    assert logits.shape == (len(batch), 256) and logits.dtype == torch.float32
    for row, prompt in zip(logits, batch, strict=True):
        torch.testing.assert_close(row, hf_last_logits(hf, prompt), atol=ATOL, rtol=RTOL)


def test_sharded_checkpoint_is_read_through_its_index(tiny) -> None:
    model_dir, _ = tiny("sharded")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["mha_untied", "gqa_tied", "llama3_rope", "qwen2_bias"])
def test_greedy_tokens_match_hf_generate_with_prefills_and_decodes_in_one_batch(tiny, name: str,
                                                                                 attention: str) -> None:
    model_dir, hf = tiny(name)
    driver = NaiveDriver(make_runner(model_dir, block_size=4, attention_kernel=attention), blocks_per_seq=16)
    batch = prompts(seed=1)

    ours = driver.greedy(batch, num_new_tokens=20)

    assert ours == [hf_greedy(hf, prompt, 20) for prompt in batch]


def test_decodes_attended_in_several_gather_chunks_give_the_same_tokens(tiny) -> None:
    model_dir, hf = tiny("gqa_tied")
    runner = make_runner(model_dir, block_size=4, attention_kernel="off")
    # A 57-token sequence spans 15 blocks of 4; K and V: 30 blocks > 8, so one sequence per chunk.
    runner.kv_cache.max_gather_blocks = 8
    batch = prompts(seed=2)

    ours = NaiveDriver(runner, blocks_per_seq=16).greedy(batch, num_new_tokens=20)

    assert ours == [hf_greedy(hf, prompt, 20) for prompt in batch]


def test_the_gather_workspace_grows_when_a_step_needs_more_blocks(tiny) -> None:
    model_dir, hf = tiny("gqa_tied")
    # Starts at 2 * (40 / 4 + 4) = 28 blocks; the last steps decode four sequences of up to 56 positions
    # (14 blocks), K and V: 112 blocks.
    runner = make_runner(model_dir, block_size=4, max_num_batched_tokens=40, max_num_seqs=4,
                         attention_kernel="off")
    assert runner.kv_cache.workspace_blocks == 28
    batch = prompts(seed=3)

    ours = NaiveDriver(runner, blocks_per_seq=16).greedy(batch, num_new_tokens=20)

    assert ours == [hf_greedy(hf, prompt, 20) for prompt in batch]
    assert runner.kv_cache.workspace_blocks >= 112


@pytest.mark.parametrize("name", ["gqa_tied", "llama3_rope"])
def test_prefill_in_chunks_of_five_gives_the_one_shot_logits(tiny, name: str) -> None:
    model_dir, hf = tiny(name)
    prompt = prompts()[-1]  # 37 tokens: 8 chunks, crossing block boundaries mid-chunk
    driver = NaiveDriver(make_runner(model_dir, block_size=4), blocks_per_seq=12)

    one_shot = driver.step([driver.chunk(0, prompt, 0)])[0]
    chunked = driver.prefill_in_chunks(1, prompt, chunk_size=5)

    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, hf_last_logits(hf, prompt), atol=ATOL, rtol=RTOL)


def test_chunks_of_several_sequences_in_one_step_match_hf(tiny) -> None:
    model_dir, hf = tiny("gqa_tied")
    batch = prompts()[1:]
    driver = NaiveDriver(make_runner(model_dir, block_size=4), blocks_per_seq=12)
    # Step 1: the first 5 tokens of each prompt; step 2: the rest of each, all sampling.
    driver.step([driver.chunk(i, p[:5], 0, sample=False) for i, p in enumerate(batch)])
    logits = driver.step([driver.chunk(i, p[5:], 5) for i, p in enumerate(batch)])

    for row, prompt in zip(logits, batch, strict=True):
        torch.testing.assert_close(row, hf_last_logits(hf, prompt), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["mha_untied", "gqa_tied"])
def test_a_sequence_reusing_anothers_cached_blocks_gets_the_from_scratch_logits(tiny, name: str) -> None:
    model_dir, hf = tiny(name)
    runner = make_runner(model_dir, block_size=4, num_blocks=64)
    shared = prompts()[-1][:24]  # 6 full blocks
    first = shared + [10, 11, 12, 13, 14, 15, 16]
    second = shared + [200, 201, 202, 203, 204]
    # The first sequence owns blocks 0..7; the second reuses blocks 0..5 for its prefix and owns 20, 21.
    runner.compute_logits(ModelInput((NaiveDriver(runner, 8).chunk(0, first, 0),)))
    table = (0, 1, 2, 3, 4, 5, 20, 21)
    reused = runner.compute_logits(ModelInput((scheduled(1, second[24:], 24, table),)))[0]
    scratch = runner.compute_logits(ModelInput((scheduled(2, second, 0, tuple(range(30, 38))),)))[0]

    torch.testing.assert_close(reused, scratch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reused, hf_last_logits(hf, second), atol=ATOL, rtol=RTOL)


def test_only_sampling_sequences_get_logit_rows_in_batch_order(tiny) -> None:
    model_dir, hf = tiny("mha_untied")
    driver = NaiveDriver(make_runner(model_dir), blocks_per_seq=4)
    a, b, c = prompts()[1:]

    logits = driver.step([driver.chunk(0, a, 0), driver.chunk(1, b, 0, sample=False), driver.chunk(2, c, 0)])

    assert logits.shape == (2, 256)
    torch.testing.assert_close(logits[0], hf_last_logits(hf, a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, c), atol=ATOL, rtol=RTOL)


def test_a_step_where_no_sequence_samples_returns_no_rows(tiny) -> None:
    model_dir, _ = tiny("mha_untied")
    driver = NaiveDriver(make_runner(model_dir), blocks_per_seq=4)

    logits = driver.step([driver.chunk(0, prompts()[-1][:10], 0, sample=False)])

    assert logits.shape == (0, 256)


@pytest.mark.parametrize("seq,message", [
    (scheduled(0, [5, 6, 7], 14, (0,)), "17 tokens need 5 blocks of 4; the block table has 1"),
    (scheduled(0, [5], 256, tuple(range(65))), "position 256 exceeds the model's limit of 256 positions"),
    (scheduled(0, [], 0, (0,)), "empty chunk"),
])
def test_malformed_batches_are_refused_before_touching_the_cache(tiny, seq, message: str) -> None:
    model_dir, _ = tiny("mha_untied")
    runner = make_runner(model_dir, block_size=4, num_blocks=80)

    with pytest.raises(ValueError, match=message):
        runner.compute_logits(ModelInput((seq,)))


def test_batches_over_the_configured_limits_are_refused(tiny) -> None:
    model_dir, _ = tiny("mha_untied")
    runner = make_runner(model_dir, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    driver = NaiveDriver(runner, blocks_per_seq=4)

    with pytest.raises(ValueError, match="batch has 9 tokens; max_num_batched_tokens is 8"):
        driver.step([driver.chunk(0, list(range(3, 12)), 0)])
    with pytest.raises(ValueError, match="batch has 3 sequences; max_num_seqs is 2"):
        driver.step([driver.chunk(i, [5], 0) for i in range(3)])


def test_bfloat16_runner_stays_close_to_float32(tiny) -> None:
    model_dir, _ = tiny("gqa_tied")
    batch = prompts()
    results = {}
    for dtype in ("float32", "bfloat16"):
        driver = NaiveDriver(make_runner(model_dir, dtype=dtype, block_size=4), blocks_per_seq=16)
        driver.step([driver.chunk(i, p[:-1], 0, sample=False) for i, p in enumerate(batch) if len(p) > 1])
        # The last token of each prompt as a decode step over the cached bfloat16 blocks.
        results[dtype] = driver.step([driver.chunk(i, p[-1:], len(p) - 1) for i, p in enumerate(batch)])

    assert results["bfloat16"].dtype == torch.float32
    scale = results["float32"].abs().max()
    assert (results["bfloat16"] - results["float32"]).abs().max() < 0.05 * scale


def test_a_bfloat16_chunk_after_cached_tokens_stays_close_to_float32(tiny) -> None:
    # The last 5 tokens of each prompt as one chunk over the cached blocks before it: on CPU in bfloat16 that is
    # `_grouped_chunk_attention` (grouped query rows, an additive mask), in float32 SDPA with a mask.
    model_dir, _ = tiny("gqa_tied")
    batch = [p for p in prompts() if len(p) > 6]
    results = {}
    for dtype in ("float32", "bfloat16"):
        driver = NaiveDriver(make_runner(model_dir, dtype=dtype, block_size=4), blocks_per_seq=16)
        driver.step([driver.chunk(i, p[:-5], 0, sample=False) for i, p in enumerate(batch)])
        results[dtype] = driver.step([driver.chunk(i, p[-5:], len(p) - 5) for i, p in enumerate(batch)])

    scale = results["float32"].abs().max()
    assert (results["bfloat16"] - results["float32"]).abs().max() < 0.05 * scale


# ---- configuration and loading errors ----


def copy_model(tiny, name: str, tmp_path: Path) -> Path:
    source, _ = tiny(name)
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def test_missing_config_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: not found"):
        make_runner_with_budget(tmp_path)


def make_runner_with_budget(model_dir: Path, kv_cache_bytes: int = 1 << 24) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", kv_cache_bytes=kv_cache_bytes)


def test_unsupported_architecture_lists_the_supported_ones(tiny, tmp_path: Path) -> None:
    model_dir = copy_model(tiny, "mha_untied", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))

    with pytest.raises(ModelLoadError) as error:
        make_runner_with_budget(model_dir)

    message = str(error.value)
    assert str(model_dir / "config.json") in message and "'architectures'" in message
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message and "Qwen2ForCausalLM" in message


@pytest.mark.parametrize("key,value,expected", [
    ("hidden_size", None, "missing required key 'hidden_size'"),
    ("num_key_value_heads", 3, "'num_key_value_heads' must divide num_attention_heads (4); got 3"),
    ("hidden_act", "gelu", "'hidden_act' must be 'silu'; got 'gelu'"),
])
def test_bad_config_values_name_the_key_and_the_value(key: str, value, expected: str) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    raw[key] = value

    with pytest.raises(ModelLoadError, match="^config.json: .*" + expected.replace("(", r"\(").replace(")", r"\)")):
        parse_model_config(raw)


def test_classic_rope_scaling_spelling_parses_like_rope_parameters() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    classic = parse_model_config({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}})
    current = parse_model_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                              **scaling}})

    assert classic == current
    assert classic.rope_scaling.rope_type == "llama3" and classic.rope_theta == 500000.0


def test_missing_tensor_names_the_file_and_the_key(tiny, tmp_path: Path) -> None:
    model_dir = copy_model(tiny, "mha_untied", tmp_path)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)

    with pytest.raises(ModelLoadError, match=rf"^{path}: missing tensor 'model.layers.1.mlp.up_proj.weight'$"):
        make_runner_with_budget(model_dir)


def test_wrong_shaped_tensor_names_the_file_the_key_and_both_shapes(tiny, tmp_path: Path) -> None:
    model_dir = copy_model(tiny, "mha_untied", tmp_path)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, path)

    with pytest.raises(ModelLoadError) as error:
        make_runner_with_budget(model_dir)

    assert str(error.value) == (f"{path}: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [32, 64]; "
                                f"expected [64, 64]")


def test_missing_tensor_in_a_sharded_checkpoint_names_the_index(tiny, tmp_path: Path) -> None:
    model_dir = copy_model(tiny, "sharded", tmp_path)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = model_dir / index["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard)

    with pytest.raises(ModelLoadError, match=rf"^{index_path}: missing tensor 'model.norm.weight'$"):
        make_runner_with_budget(model_dir)


def test_kv_budget_below_one_block_says_what_a_block_needs(tiny) -> None:
    model_dir, _ = tiny("gqa_tied")
    # 3 layers x K,V x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 12,288 bytes
    with pytest.raises(ModelLoadError, match="kv_cache_bytes=12287 holds no KV block: .* needs 12288 bytes"):
        make_runner_with_budget(model_dir, kv_cache_bytes=12287)
    assert make_runner_with_budget(model_dir, kv_cache_bytes=12288 * 10 + 5).num_kv_blocks == 10
