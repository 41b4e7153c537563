"""Multi-LoRA through the whole engine, on a tiny random HF Llama (GQA: k/v project to half of q, 3 layers,
wide init) and two random PEFT adapters:
    sql   rank 4, alpha 8 (scale 2), all seven projections
    chat  rank 8, alpha 12 with rsLoRA (scale 12 / sqrt(8) = 4.24), q, v, gate and down only
The reference for an adapter is transformers running the same model with the adapter merged into its
weights (W + scale * B @ A), so these tests check the PEFT reading, the scale, the fused q/k/v and gate/up
slices, and the grouping of a mixed batch, all at once.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.lora import AdapterInfo, AdapterLoadError, UnknownAdapter
from tests.engine.hf_models import hf_greedy
from tests.engine.lora_adapters import ALL_MODULES, AdapterSpec, merged, tiny_hf_model, write_adapter

SPECS = {
    "sql": AdapterSpec(rank=4, alpha=8, targets=ALL_MODULES, seed=1),
    "chat": AdapterSpec(rank=8, alpha=12, targets=("q_proj", "v_proj", "gate_proj", "down_proj"), seed=2,
                        use_rslora=True),
}
NUM_NEW = 12
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


class Tiny:
    """The base model's directory and HF model, and each adapter's directory and merged HF model."""

    def __init__(self, root: Path) -> None:
        self.model_dir = root / "model"
        self.hf = tiny_hf_model(self.model_dir)
        self.adapter_dirs: dict[str, Path] = {}
        self.merged: dict[str, torch.nn.Module] = {}
        for name, spec in SPECS.items():
            self.adapter_dirs[name] = root / name
            self.merged[name] = merged(self.hf, write_adapter(root / name, self.hf, spec), spec)

    def llm(self, **overrides) -> LLM:
        settings = {"kv_cache_bytes": 2 << 20, "block_size": 16, "max_num_batched_tokens": 256,
                    "adapters": [(name, str(path)) for name, path in self.adapter_dirs.items()]}
        return LLM(str(self.model_dir), **{**settings, **overrides})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("lora"))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 45))] for _ in range(count)]


def tokens(outputs) -> list[list[int]]:
    return [out.token_ids for out in outputs]


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_tokens_under_an_adapter_match_hf_with_the_adapter_merged(tiny: Tiny, name: str) -> None:
    batch = prompts(3)
    llm = tiny.llm()

    ours = tokens(llm.generate(batch, GREEDY, adapter=name))

    assert ours == [hf_greedy(tiny.merged[name], prompt, NUM_NEW) for prompt in batch]
    assert ours != tokens(llm.generate(batch, GREEDY))  # the adapter changes the output


def test_a_batch_mixing_base_and_two_adapters_gives_each_request_its_tokens_alone(tiny: Tiny) -> None:
    batch = prompts(7, seed=1)
    adapters = [None, "sql", "chat", "sql", None, "chat", "sql"]  # decodes: 3 sql rows, 2 chat rows
    alone = tiny.llm(enable_prefix_caching=False)
    expected = [alone.generate([p], GREEDY, adapter=a)[0].token_ids for p, a in zip(batch, adapters)]

    # 24 tokens a step: prompts are prefilled in chunks while others decode, under different adapters.
    llm = tiny.llm(max_num_batched_tokens=24)
    steps: list[set[str | None]] = []
    compute_logits = llm.core.runner.compute_logits
    llm.core.runner.compute_logits = lambda b: steps.append({s.adapter for s in b.seqs}) or compute_logits(b)
    mixed = llm.generate(batch, GREEDY, adapter=adapters)

    assert tokens(mixed) == expected
    assert {None, "sql", "chat"} in steps  # some steps held all three


def test_with_one_slot_two_adapters_take_turns_and_stay_correct(tiny: Tiny) -> None:
    batch = prompts(4, seed=2)
    adapters = ["sql", "chat", "sql", "chat"]
    expected = [hf_greedy(tiny.merged[a], p, NUM_NEW) for p, a in zip(batch, adapters)]
    llm = tiny.llm(max_loras=1)
    assert llm.core.adapters() == AdapterInfo(registered=("chat", "sql"), loaded=("sql",))  # the first fits

    outputs = llm.generate(batch, GREEDY, adapter=adapters)

    assert tokens(outputs) == expected
    stats = llm.core.stats()
    # LoRA requests run in arrival order: sql (loaded at start), chat (evicts sql), sql, chat.
    assert (stats.num_adapter_loads_total, stats.num_adapter_evictions_total) == (4, 3)
    assert stats.adapters_loaded == ("chat",)


def test_the_same_prompt_under_two_adapters_shares_no_prefix_blocks(tiny: Tiny) -> None:
    [prompt] = prompts(1, seed=3)
    prompt = (prompt * 3)[:40]  # 40 tokens: 2 full blocks of 16 can be served from the cache
    llm = tiny.llm()
    one = SamplingParams(max_tokens=1, temperature=0.0)

    cached = [llm.generate([prompt], one, adapter=a)[0].num_cached_tokens for a in ("sql", "chat", "sql", None)]

    assert cached == [0, 0, 32, 0]


def test_load_errors_name_the_problem_and_the_engine_keeps_serving(tiny: Tiny, tmp_path: Path) -> None:
    llm = tiny.llm()
    before = llm.core.adapters()
    bad_shapes = tmp_path / "bad-shapes"
    write_adapter(bad_shapes, tiny_hf_model(tmp_path / "other", "mha_untied"), SPECS["sql"])  # 4 KV heads, not 2
    too_big = tmp_path / "rank-32"
    write_adapter(too_big, tiny.hf, AdapterSpec(rank=32, alpha=32, targets=("q_proj",), seed=3))

    with pytest.raises(AdapterLoadError, match="no such adapter directory"):
        llm.core.load_adapter("missing", str(tmp_path / "nowhere"))
    with pytest.raises(AdapterLoadError, match=r"k_proj\.lora_B\.weight' has shape \[64, 4\]; the base model's "
                                               r"k_proj at rank 4 needs \[32, 4\]"):
        llm.core.load_adapter("bad-shapes", str(bad_shapes))
    with pytest.raises(AdapterLoadError, match="key 'r' is 32, above this engine's max_lora_rank 16"):
        llm.core.load_adapter("rank-32", str(too_big))

    assert llm.core.adapters() == before
    batch = prompts(2, seed=4)
    assert tokens(llm.generate(batch, GREEDY, adapter="sql")) == [hf_greedy(tiny.merged["sql"], p, NUM_NEW)
                                                                 for p in batch]


def test_an_unknown_adapter_is_refused_before_any_work(tiny: Tiny) -> None:
    llm = tiny.llm()
    with pytest.raises(UnknownAdapter, match="unknown adapter 'nope'; registered adapters: chat, sql"):
        llm.generate(prompts(2), GREEDY, adapter=["sql", "nope"])
    assert not llm.core.has_unfinished()


def test_an_adapter_loaded_at_run_time_serves_and_unloading_it_refuses_new_requests(tiny: Tiny) -> None:
    llm = tiny.llm(adapters=[])
    [prompt] = prompts(1, seed=5)

    llm.core.load_adapter("late", str(tiny.adapter_dirs["chat"]))
    llm.core.load_adapter("late", str(tiny.adapter_dirs["chat"]))  # idempotent

    assert llm.core.adapters() == AdapterInfo(registered=("late",), loaded=("late",))
    assert llm.generate([prompt], GREEDY, adapter="late")[0].token_ids == hf_greedy(tiny.merged["chat"], prompt,
                                                                                    NUM_NEW)
    assert llm.core.unload_adapter("late") is True
    assert llm.core.unload_adapter("late") is False  # no longer registered
    assert llm.core.adapters() == AdapterInfo(registered=(), loaded=())
    with pytest.raises(UnknownAdapter):
        llm.generate([prompt], GREEDY, adapter="late")


def test_a_load_that_fails_inside_a_step_fails_only_that_call(tiny: Tiny, tmp_path: Path) -> None:
    chat = tmp_path / "chat"
    shutil.copytree(tiny.adapter_dirs["chat"], chat)
    llm = tiny.llm(max_loras=1, adapters=[("sql", str(tiny.adapter_dirs["sql"])), ("chat", str(chat))])
    weights = chat / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # validated at start, then damaged before its first use

    with pytest.raises(AdapterLoadError, match="cannot read the adapter's tensors"):
        llm.generate(prompts(2, seed=6), GREEDY, adapter=[None, "chat"])

    assert not llm.core.has_unfinished()
    assert llm.core.adapters().registered == ("chat", "sql")  # the next request retries the load
    batch = prompts(1, seed=7)
    assert tokens(llm.generate(batch, GREEDY, adapter="sql")) == [hf_greedy(tiny.merged["sql"], batch[0], NUM_NEW)]
