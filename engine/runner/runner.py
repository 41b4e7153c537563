"""ModelRunner: loads a model and its paged KV cache, and turns a scheduled batch into logits.

One step is one forward pass over every token of the batch, flattened: the embedding, each layer's
projections and MLP run as single matmuls over all tokens; attention alone follows sequence boundaries
through StepMetadata (built once per step, shared by every layer). Logits are computed only at the last
token of each sequence that samples, which skips the vocabulary projection for the rest of a prefill.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvgate.engine.config import ModelConfig, ModelLoadError, load_model_config
from kvgate.engine.runner.allocator import keep_freed_memory
from kvgate.engine.runner.attention import build_step_metadata
from kvgate.engine.runner.kernels import KernelLoader
from kvgate.engine.runner.kv_cache import PagedKVCache, bytes_per_block
from kvgate.engine.runner.linear import pick_linear
from kvgate.engine.runner.lora import LoraSlots
from kvgate.engine.runner.model import LlamaModel
from kvgate.engine.runner.weights import load_weights
from kvgate.engine.sequence import ModelInput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """"auto" takes the checkpoint's dtype (float32 when the config does not say)."""
    if name == "auto":
        name = config.torch_dtype or "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """None picks CUDA when available, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested, but this torch build sees no CUDA device")
    return device


class ModelRunner:
    """The model, its weights and its KV cache on one device.

    Attributes: `config` (the parsed config.json), `num_kv_blocks` (blocks of `block_size` tokens that
    kv_cache_bytes holds; the block manager hands out ids 0 .. num_kv_blocks - 1), `device`, `dtype`.
    `compute_logits` is not reentrant: steps run one at a time, since they share the cache's workspace.
    With max_loras > 0, `lora` holds that many adapter slots (lora.py) and a step may mix adapters.
    `attention_kernel` ("auto", "wait", "off") says whether CPU decodes use the compiled kernel (kernels.py).
    The constructor raises ModelLoadError when the model directory cannot be loaded or the KV budget does
    not hold one block, and ValueError for a bad argument.
    """

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str | None = None,
                 kv_cache_bytes: int, block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, max_loras: int = 0, max_lora_rank: int = 16,
                 attention_kernel: str = "auto") -> None:
        for name, value in (("kv_cache_bytes", kv_cache_bytes), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0 or max_lora_rank < 1:
            raise ValueError(f"max_loras must be an integer >= 0 and max_lora_rank >= 1; "
                             f"got {max_loras!r} and {max_lora_rank!r}")
        self.config = load_model_config(model_dir)
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # steps reuse their activations' memory instead of faulting it in anew
        # First, so that a kernel build (when there is no cached one) overlaps loading the model.
        self.kernels = KernelLoader(attention_kernel, self.device)
        self.dtype = resolve_dtype(dtype, self.config)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        block_bytes = bytes_per_block(num_layers=self.config.num_hidden_layers, block_size=block_size,
                                      num_kv_heads=self.config.num_key_value_heads,
                                      head_dim=self.config.head_dim, dtype=self.dtype)
        if kv_cache_bytes < block_bytes:
            raise ModelLoadError(
                f"kv_cache_bytes={kv_cache_bytes} holds no KV block: one block of {block_size} tokens needs "
                f"{block_bytes} bytes ({self.config.num_hidden_layers} layers x K,V x {block_size} tokens x "
                f"{self.config.num_key_value_heads} kv heads x {self.config.head_dim} dims x "
                f"{torch.empty((), dtype=self.dtype).element_size()} bytes per value)")
        self.num_kv_blocks = kv_cache_bytes // block_bytes
        # How long each part of loading took, for the engine's start-up line and the cold-start benchmark.
        clock = time.perf_counter
        started = clock()
        with torch.inference_mode():
            self.model = LlamaModel(self.config, self.dtype, self.device)
            built = clock()
            load_weights(self.model, model_dir)
            loaded = clock()
            self.linear_backend = pick_linear(self.device, self.dtype)
            self.model.prepare(self.linear_backend)
        self.load_seconds = {"build": built - started, "weights": loaded - built, "prepare": clock() - loaded}
        self.lora = LoraSlots(self.model.layers, self.config, max_loras=max_loras, max_rank=max_lora_rank,
                              dtype=self.dtype, device=self.device) if max_loras else None
        # The workspace starts large enough for a step whose sequences hold about max_num_batched_tokens
        # tokens plus one partly filled block each, K and V; it doubles if a step needs more.
        workspace_blocks = 2 * min(self.num_kv_blocks, -(-max_num_batched_tokens // block_size) + max_num_seqs)
        kv_started = clock()
        self.kv_cache = PagedKVCache(
            num_layers=self.config.num_hidden_layers, num_blocks=self.num_kv_blocks, block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim, dtype=self.dtype,
            device=self.device, initial_workspace_blocks=workspace_blocks)
        self.load_seconds["kv_cache"] = clock() - kv_started

    @torch.inference_mode()
    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy KV blocks, (source, destination) pairs: a fork's copy of its first sample's partial block."""
        self.kv_cache.copy_blocks(copies)

    @torch.inference_mode()
    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """Run one step: write the KV of every scheduled token into the cache and return float32 logits
        [number of sequences with sample=True, vocab_size], rows in batch order.

        Raises ValueError for a batch over max_num_seqs or max_num_batched_tokens, a position past the
        model's limit, a block table that does not cover its positions, or an adapter not in a slot."""
        if len(batch.seqs) > self.max_num_seqs:
            raise ValueError(f"batch has {len(batch.seqs)} sequences; max_num_seqs is {self.max_num_seqs}")
        if batch.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"batch has {batch.num_tokens} tokens; max_num_batched_tokens is "
                             f"{self.max_num_batched_tokens}")
        self.copy_blocks(batch.block_copies)
        groups, sample_order = None, None
        if any(seq.adapter is not None for seq in batch.seqs):
            if self.lora is None:
                raise ValueError("the batch names LoRA adapters; this runner has no adapter slots (max_loras 0)")
            # Each adapter's tokens become contiguous rows; logits come back in the batch's order.
            batch, groups, sample_order = self.lora.arrange(batch)
        meta = build_step_metadata(batch, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                                   max_positions=self.config.max_position_embeddings,
                                   max_gather_blocks=self.kv_cache.max_gather_blocks, device=self.device,
                                   decode_kernel=self.kernels.paged_attention)
        hidden = self.model(meta, self.kv_cache, groups)
        if meta.sample_indices.numel() == 0:  # a step of prefill chunks that all stop short of the end
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        sample_indices = meta.sample_indices
        if sample_order is not None:
            sample_indices = sample_indices[torch.tensor(sample_order, device=sample_indices.device)]
        return self.model.logits(hidden.index_select(0, sample_indices))
