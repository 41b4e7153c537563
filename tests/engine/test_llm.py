"""The whole engine through its offline API: scheduling, paged KV, prefix cache, sampling, stops.

The equivalence tests run a tiny-llama whose weights are scaled up 10x (std 0.2): random weights at
std 0.02 give near-flat logits and greedy output that repeats one token, which would hide mistakes.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.engine import LLM, FinishReason, SamplingParams
from kvgate.engine.config import load_model_config
from kvgate.engine.runner.kv_cache import bytes_per_block
from tests.engine.builtin_cache import shared_cache_dir, tiny_llama_dir

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("sharp-tiny-llama")
    for item in tiny_llama_dir().iterdir():
        if item.is_file():
            shutil.copy(item, directory / item.name)
    weights = load_file(directory / "model.safetensors")
    scaled = {name: (t if "norm" in name else t * 10) for name, t in weights.items()}
    save_file(scaled, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def prompts(count: int, seed: int = 0, low: int = 40, high: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def make_llm(model: Path, **overrides) -> LLM:
    settings = {"kv_cache_bytes": 4 << 20, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 512}
    return LLM(str(model), **{**settings, **overrides})


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_greedy_output_is_varied_so_the_equivalence_tests_mean_something(sharp_model: Path) -> None:
    [out] = make_llm(sharp_model).generate(prompts(1), GREEDY)
    assert len(set(out.token_ids)) > 5


def test_chunked_prefill_gives_the_same_tokens_as_one_shot_prefill(sharp_model: Path) -> None:
    batch = prompts(6)
    one_shot = make_llm(sharp_model, max_num_batched_tokens=2048).generate(batch, GREEDY)
    chunked = make_llm(sharp_model, max_num_batched_tokens=24).generate(batch, GREEDY)  # 7 tokens/chunk and less
    assert token_ids(chunked) == token_ids(one_shot)


def test_a_prefix_cache_hit_gives_the_same_tokens_as_a_miss_and_is_counted(sharp_model: Path) -> None:
    shared = prompts(1, seed=1, low=70, high=71)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    cold = make_llm(sharp_model, enable_prefix_caching=False).generate([second], GREEDY)
    llm = make_llm(sharp_model)
    llm.generate([first], GREEDY)
    hits_before = llm.core.block_manager.hit_tokens_total
    [warm] = llm.generate([second], GREEDY)
    assert warm.token_ids == cold[0].token_ids
    assert warm.num_cached_tokens == 64  # 70 shared tokens = 4 full blocks of 16 (+6 that are not a block)
    assert llm.core.block_manager.hit_tokens_total - hits_before == 64


def test_prompts_sharing_a_prefix_at_once_compute_it_once_and_match_the_tokens_of_a_cold_run(
        sharp_model: Path) -> None:
    shared = prompts(1, seed=3, low=100, high=101)[0]  # 6 full blocks of 16, and 4 tokens
    batch = [shared + [7 + i, 8 + i] for i in range(4)]
    cold = make_llm(sharp_model, enable_prefix_caching=False).generate(batch, GREEDY)
    llm = make_llm(sharp_model)
    together = llm.generate(batch, GREEDY)  # all four are waiting when the first step is scheduled
    assert token_ids(together) == token_ids(cold)
    assert [o.num_cached_tokens for o in together] == [0, 96, 96, 96]
    assert llm.core.scheduler.num_prefix_waits_total == 3


def test_a_tiny_kv_budget_forces_preemption_and_eviction_but_not_different_tokens(sharp_model: Path) -> None:
    batch = prompts(8, seed=2)
    roomy = make_llm(sharp_model).generate(batch, GREEDY)
    # 12 blocks of 16 tokens: one sequence (<= 143 tokens) fits, eight at once do not.
    config = load_model_config(sharp_model)
    block_bytes = bytes_per_block(num_layers=config.num_hidden_layers, block_size=16,
                                  num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                  dtype=torch.float32)
    tight = make_llm(sharp_model, kv_cache_bytes=12 * block_bytes, max_model_len=192)
    assert token_ids(tight.generate(batch, GREEDY)) == token_ids(roomy)
    assert tight.core.scheduler.num_preemptions_total > 0
    assert tight.core.block_manager.num_free_blocks == tight.core.block_manager.num_total_blocks


def test_outputs_do_not_depend_on_batch_composition(sharp_model: Path) -> None:
    batch = prompts(5, seed=3)
    together = make_llm(sharp_model).generate(batch, GREEDY)
    alone = [make_llm(sharp_model).generate([p], GREEDY)[0] for p in batch[:2]]
    assert token_ids(alone) == token_ids(together[:2])


def test_seeded_sampling_is_reproducible(sharp_model: Path) -> None:
    llm = make_llm(sharp_model)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    [a] = llm.generate(prompts(1, seed=4), params)
    [_, b, _] = llm.generate(prompts(1, seed=9) + prompts(1, seed=4) + prompts(1, seed=8), [
        SamplingParams(max_tokens=20, temperature=1.0), params, SamplingParams(max_tokens=5, temperature=0.7)])
    assert a.token_ids == b.token_ids
    [c] = llm.generate(prompts(1, seed=4), SamplingParams(**{**params.__dict__, "seed": 99}))
    assert c.token_ids != a.token_ids


def test_stop_strings_cut_the_text_and_finish(sharp_model: Path) -> None:
    llm = make_llm(sharp_model)
    [full] = llm.generate(prompts(1, seed=5), GREEDY)
    text = full.text
    stop = text[7:10]  # three characters from the middle of what it would write
    assert stop and text.index(stop) >= 1
    [cut] = llm.generate(prompts(1, seed=5), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                            stop=(stop,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == text[: text.index(stop)]


def test_max_tokens_and_text_prompts(sharp_model: Path) -> None:
    [out] = make_llm(sharp_model).generate("Hello there", SamplingParams(max_tokens=5, temperature=0,
                                                                         ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH


def test_bad_prompts_are_clear_errors(sharp_model: Path) -> None:
    llm = make_llm(sharp_model, max_model_len=128)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="at most 127 prompt tokens"):
        llm.generate([[5] * 200], GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 290\)"):
        llm.generate([[5, 999]], GREEDY)


def test_smollm2_knows_the_capital_of_france() -> None:
    llm = LLM("builtin:smollm2-135m", kv_cache_bytes=64 << 20, cache_dir=shared_cache_dir())
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason is FinishReason.STOP
