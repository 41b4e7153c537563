"""Tiny random Hugging Face models saved as safetensors checkpoints, and a naive driver that runs a
ModelRunner the way the scheduler would, without the scheduling: sequence i owns the contiguous blocks
i * blocks_per_seq .. (i + 1) * blocks_per_seq - 1.

Models are float32 with a fixed seed and a wide initialisation (0.2), so logits are peaked enough that
greedy decoding has no near-ties for rounding to flip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvgate.engine.config import load_model_config
from kvgate.engine.runner.kv_cache import bytes_per_block
from kvgate.engine.runner.runner import ModelRunner, resolve_dtype
from kvgate.engine.sequence import ModelInput, SamplingParams, ScheduledSeq

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class TinySpec:
    """One tiny architecture: hidden 64, 4 heads of 16, vocab 256."""

    name: str
    num_kv_heads: int = 4
    num_layers: int = 2
    tied: bool = False
    rope_parameters: dict | None = None
    family: str = "llama"  # llama | mistral | qwen2
    max_shard_size: str | None = None  # set to shard the checkpoint (writes model.safetensors.index.json)
    extra: dict = field(default_factory=dict)


SPECS = {
    spec.name: spec
    for spec in (
        TinySpec("mha_untied", num_kv_heads=4),
        TinySpec("gqa_tied", num_kv_heads=2, num_layers=3, tied=True),
        # original length 32: with head_dim 16 the wavelengths (6 .. 20,000 positions) fall in all three
        # llama3 bands (kept < 8, blended 8..32, scaled > 32).
        TinySpec("llama3_rope", num_kv_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        TinySpec("linear_rope", num_kv_heads=1, rope_parameters={
            "rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}),
        TinySpec("sharded", num_kv_heads=2, max_shard_size="40KB"),
        TinySpec("mistral", family="mistral", num_kv_heads=2),
        TinySpec("qwen2_bias", family="qwen2", num_kv_heads=2, tied=True),
    )
}

_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def build_tiny_model(spec: TinySpec, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Create the random model, save it to `directory` as safetensors, return it (float32, eval mode)."""
    config_class, model_class = _FAMILIES[spec.family]
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=spec.num_layers,
        num_attention_heads=4, num_key_value_heads=spec.num_kv_heads, max_position_embeddings=256,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=spec.tied, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, **spec.extra,
    )
    if spec.rope_parameters is not None:
        kwargs["rope_parameters"] = spec.rope_parameters
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).float().eval()
    save_kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    return model


def hf_last_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False), never stopping early."""
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=num_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def make_runner(model_dir: Path, *, block_size: int = 16, num_blocks: int = 64, dtype: str = "float32",
                **kwargs) -> ModelRunner:
    """A runner whose KV budget holds exactly `num_blocks` blocks."""
    config = load_model_config(model_dir)
    block_bytes = bytes_per_block(num_layers=config.num_hidden_layers, block_size=block_size,
                                  num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                  dtype=resolve_dtype(dtype, config))
    return ModelRunner(model_dir, dtype=dtype, device="cpu", kv_cache_bytes=num_blocks * block_bytes,
                       block_size=block_size, **kwargs)


def scheduled(seq_id: int, token_ids: list[int], start_pos: int, block_table: tuple[int, ...],
              sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(seq_id=seq_id, token_ids=tuple(token_ids), start_pos=start_pos,
                        block_table=block_table, sample=sample, params=GREEDY, output_token_ids=())


class NaiveDriver:
    """Sequence i owns blocks i * blocks_per_seq onwards; a block table lists as many as positions need."""

    def __init__(self, runner: ModelRunner, blocks_per_seq: int) -> None:
        self.runner = runner
        self.blocks_per_seq = blocks_per_seq

    def table(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        count = -(-num_tokens // self.runner.block_size)
        if count > self.blocks_per_seq:
            raise ValueError(f"sequence {seq_id} needs {count} blocks; it owns {self.blocks_per_seq}")
        first = seq_id * self.blocks_per_seq
        return tuple(range(first, first + count))

    def chunk(self, seq_id: int, tokens: list[int], start_pos: int, sample: bool = True) -> ScheduledSeq:
        return scheduled(seq_id, tokens, start_pos, self.table(seq_id, start_pos + len(tokens)), sample)

    def step(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        return self.runner.compute_logits(ModelInput(tuple(seqs)))

    def prefill_in_chunks(self, seq_id: int, prompt: list[int], chunk_size: int) -> torch.Tensor:
        """Feed the prompt chunk_size tokens per step; the logits of the last step (one row)."""
        logits = None
        for start in range(0, len(prompt), chunk_size):
            piece = prompt[start:start + chunk_size]
            last = start + len(piece) == len(prompt)
            logits = self.step([self.chunk(seq_id, piece, start, sample=last)])
        return logits[0]

    def greedy(self, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        """Greedy decoding with staggered arrivals: sequence i is admitted (its whole prompt prefilled) at
        step i while the earlier ones decode, so steps mix prefills and decodes. Sequences are listed
        newest first, so the prefill precedes the decodes in the flattened batch."""
        outputs: list[list[int]] = [[] for _ in prompts]
        admitted = 0
        while any(len(out) < num_new_tokens for out in outputs):
            seqs = []
            for i in range(admitted):
                if len(outputs[i]) < num_new_tokens:
                    tokens = prompts[i] + outputs[i]
                    seqs.append(self.chunk(i, tokens[-1:], len(tokens) - 1))
            if admitted < len(prompts):
                seqs.append(self.chunk(admitted, prompts[admitted], 0))
                admitted += 1
            seqs.reverse()
            next_tokens = self.step(seqs).argmax(dim=-1).tolist()
            for seq, token in zip(seqs, next_tokens, strict=True):
                outputs[seq.seq_id].append(token)
        return outputs
