"""A Llama-family decoder in plain PyTorch, computing over the step's flattened tokens.

Shapes are [num_tokens, ...] throughout: every token of every scheduled sequence goes through the
projections and the MLP as one matrix, and only attention looks at sequence boundaries (attention.py).
The q/k/v projections are fused into one weight, and so are gate/up, so a layer is four matmuls.

Weights are plain tensors, not nn.Parameters: the model only runs inference. weights.py fills them in HF
layout, then `prepare()` hands each projection weight to the matmul backend (linear.py), which may
repack it into a layout only that backend reads.

Numerics follow Hugging Face's LlamaForCausalLM: rotary tables computed in float32 and cast to the model
dtype, RMSNorm statistics in float32 (fused with its weight, which in half precision rounds once where HF
rounds twice).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvgate.engine.config import ModelConfig, RopeScaling
from kvgate.engine.runner.attention import StepMetadata, paged_attention
from kvgate.engine.runner.kv_cache import PagedKVCache
from kvgate.engine.runner.linear import TorchLinear, OneDnnLinear
from kvgate.engine.runner.lora import LoraGroups, LoraStack


class Linear:
    """y = x W^T + b. `weight` is [out, in] in HF layout until `prepare`, then whatever the backend reads.
    With LoRA slots attached (`lora`, see lora.py), a step that passes LoraGroups adds each slot's delta to
    its rows; without them the base path runs unchanged."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        self.backend: TorchLinear | OneDnnLinear = TorchLinear()
        self.lora: LoraStack | None = None

    def prepare(self, backend: TorchLinear | OneDnnLinear) -> None:
        self.weight = backend.prepare(self.weight)
        self.backend = backend

    def __call__(self, x: torch.Tensor, lora: LoraGroups | None = None) -> torch.Tensor:
        y = self.backend(x, self.weight, self.bias)
        if lora is not None and self.lora is not None:
            self.lora.add_delta(x, y, lora)
        return y


class RMSNorm:
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        self.eps = eps
        self.weight = torch.empty(size, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, scaled as the config says (as HF computes them)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Wavelengths (in positions) above original / low_freq_factor are stretched `factor` times, those below
    # original / high_freq_factor are kept, and those between blend the two. With original 8192, factors
    # 1 and 4: wavelengths over 8192 are scaled, under 2048 kept.
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position, [max_positions, head_dim / 2], looked up once per step."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rotary_inv_freq(config))
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim / 2] each, broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [num_tokens, heads, head_dim] by position, halves layout (HF's rotate_half):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer:
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        hidden, inter = config.hidden_size, config.intermediate_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(self.q_size + 2 * self.kv_size, hidden, config.qkv_bias, dtype, device)  # q, k, v rows
        self.o_proj = Linear(hidden, self.q_size, config.o_bias, dtype, device)
        self.gate_up_proj = Linear(2 * inter, hidden, config.mlp_bias, dtype, device)  # gate rows, then up rows
        self.down_proj = Linear(hidden, inter, config.mlp_bias, dtype, device)

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StepMetadata,
                 cache: PagedKVCache, lora: LoraGroups | None = None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(hidden), lora)
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qk, cos, sin)  # q and k heads rotated in one pass
        query, key = qk[:, :self.num_heads], qk[:, self.num_heads:]
        value = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = paged_attention(self.index, query, key, value, meta, cache)
        hidden = hidden + self.o_proj(attn.reshape(num_tokens, self.q_size), lora)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden), lora).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up, lora)


class LlamaModel:
    """Embedding, decoder layers, final norm and LM head. Tensors start uninitialised: weights.py fills
    them, then `prepare` readies the projections for the matmul backend. With tied embeddings the LM head
    starts as the embedding matrix itself (a backend that repacks it makes its own copy)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.embed_tokens = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = [DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(config, dtype, device)
        self.lm_head = Linear(config.vocab_size, config.hidden_size, False, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens

    def prepare(self, backend: TorchLinear | OneDnnLinear) -> None:
        """Hand every projection to `backend`; call once, after the weights are loaded."""
        for layer in self.layers:
            for linear in layer.linears():
                linear.prepare(backend)
        self.lm_head.prepare(backend)

    def __call__(self, meta: StepMetadata, cache: PagedKVCache, lora: LoraGroups | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the last layer (before the final norm); writes every
        layer's K and V for the step's tokens into the cache. `lora`: which rows use which adapter slot."""
        hidden = F.embedding(meta.input_ids, self.embed_tokens)
        cos, sin = self.rotary.tables(meta.positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta, cache, lora)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in float32 for the given rows of last-layer hidden states."""
        return self.lm_head(self.norm(hidden)).float()
