"""A prompt chunk's attention over cached keys in bfloat16 on CPU (`_grouped_chunk_attention`): grouped query rows,
the shifted causal mask as an additive bias, against float32 SDPA over the same numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.engine.runner.attention import PrefillChunk, _grouped_chunk_attention


@pytest.mark.parametrize("heads,kv_heads,chunk_len,cached", [(9, 3, 112, 912), (4, 4, 5, 11), (8, 2, 1, 30)])
def test_grouped_chunk_attention_matches_float32_sdpa(heads: int, kv_heads: int, chunk_len: int, cached: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_keys, dim = cached + chunk_len, 64
    query = torch.randn(chunk_len, heads, dim, generator=gen)
    keys, values = (torch.randn(num_keys, kv_heads, dim, generator=gen) for _ in range(2))
    positions = torch.arange(cached, num_keys)
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]  # query i sees keys 0 .. cached + i
    chunk = PrefillChunk(0, chunk_len, num_keys, torch.zeros(1, dtype=torch.int64), mask)

    out = _grouped_chunk_attention(query.bfloat16(), keys.bfloat16(), values.bfloat16(), chunk)

    # Query head h reads KV head h // (heads / kv_heads), as HF's repeat_kv lays them out.
    q, k, v = (x.bfloat16().float().transpose(0, 1)[None] for x in (query, keys, values))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    assert out.dtype == torch.bfloat16 and out.shape == (chunk_len, heads, dim)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    group = heads // kv_heads
    assert chunk.grouped_bias(group, torch.bfloat16) is chunk.grouped_bias(group, torch.bfloat16)  # made once
