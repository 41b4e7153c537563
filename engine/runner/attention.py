"""Paged attention: per-step metadata, built once from the scheduler's ModelInput, and the attention of one
layer over the paged KV cache.

Per layer, the step's new keys and values are first written at their slots; then
  - sequences with one new token (decodes) are attended together. On CPU, when the compiled kernel is
    there (kernels.py, csrc/paged_attention.cpp), it reads their blocks where they lie through the block
    tables (KernelDecode). Otherwise (on CUDA, without a compiler, while the kernel builds) their blocks are
    gathered into the
    workspace as a padded batch [num_seqs, max_blocks * block_size] and one scaled_dot_product_attention
    call runs with a key-padding mask. Grouped-query heads need no copies: the `group` query heads that
    share a KV head ride as `group` query rows of that head (one query each, so no causal mask).
    On CPU the batch is cut into chunks of a few MiB of keys and values, so that attention reads the
    gathered blocks from cache rather than memory: for 16 sequences of 272 tokens, 12 heads of 64, float32,
    the 27 MB gather plus attention per layer took 3.4 ms at once and 1.7 ms in chunks of 8 MiB;
  - every longer chunk (a whole prompt, or a piece of one) is attended on its own. A chunk starting at position
    0 attends to its own fresh keys with the plain causal mask; a chunk with cached tokens before it
    (chunked prefill, prefix-cache hit) gathers its blocks and uses a causal mask shifted by start_pos:
    query i (at position start_pos + i) sees keys 0 .. start_pos + i. In bfloat16 on CPU such a chunk skips SDPA
    (`_grouped_chunk_attention`: grouped query rows, three batched products, the mask as a bias), which took a
    prefix hit's time to first token from 0.17x the cold one to 0.12x.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvgate.engine.runner.kv_cache import PagedKVCache
from kvgate.engine.sequence import ModelInput, ScheduledSeq


@dataclass(frozen=True)
class DecodeChunk:
    """Sequences seq_start .. seq_end - 1 of a DecodeGroup, gathered and attended together."""

    seq_start: int
    seq_end: int
    kv_block_ids: torch.Tensor  # [2 * seqs * max_blocks]: block ids, then the same + num_blocks (V blocks)


@dataclass(frozen=True)
class DecodeGroup:
    """The step's single-token sequences, attended in padded SDPA calls of up to `max_gather_blocks`."""

    # Rows of these tokens in the step's flattened tokens; None when the step is only these tokens, in order
    # (the common all-decode step skips a gather of the queries and a scatter of the outputs).
    token_indices: torch.Tensor | None
    chunks: tuple[DecodeChunk, ...]
    num_seqs: int
    max_blocks: int  # blocks of the longest sequence; shorter ones are padded with block 0 and masked
    key_mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool, True where a key exists


@dataclass(frozen=True)
class KernelDecode:
    """The step's single-token sequences, attended by the compiled kernel straight from the block tables."""

    token_indices: torch.Tensor | None  # as DecodeGroup's
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    query_start: torch.Tensor  # [num_seqs + 1] int64: 0, 1, .., num_seqs (one query row each)
    start_pos: torch.Tensor  # [num_seqs] int64: each sequence's position, so keys 0 .. start_pos
    kernel: Callable[..., None]


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's chunk of more than one token, attended on its own."""

    token_start: int  # rows token_start .. token_end - 1 of the step's flattened tokens
    token_end: int
    num_keys: int  # start_pos + chunk length: keys at positions 0 .. num_keys - 1
    kv_block_ids: torch.Tensor | None  # like DecodeGroup's; None when start_pos == 0 (fresh keys suffice)
    mask: torch.Tensor | None  # [chunk length, num_keys] bool, causal shifted by start_pos; None at 0
    # The mask as an additive bias over grouped query rows, per (group, dtype): made by the first layer, reused.
    biases: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def grouped_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """[group * chunk length, num_keys]: 0 where the mask lets a query see a key, -inf elsewhere; the rows
        are (g, query) pairs, g major, as `_grouped_chunk_attention` lays its queries out."""
        assert self.mask is not None
        bias = self.biases.get((group, dtype))
        if bias is None:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias = bias.masked_fill_(~self.mask, float("-inf")).repeat(group, 1)
            self.biases[(group, dtype)] = bias
        return bias


@dataclass(frozen=True)
class StepMetadata:
    """Everything one forward pass needs besides the weights and the cache, on the model's device."""

    input_ids: torch.Tensor  # [num_tokens] int64, every scheduled token, sequence by sequence
    positions: torch.Tensor  # [num_tokens] int64, each token's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each token's K and V are written
    sample_indices: torch.Tensor  # [num_sampling_seqs] int64, the row of each sampling sequence's last token
    decode: DecodeGroup | KernelDecode | None
    prefills: tuple[PrefillChunk, ...]


def build_step_metadata(batch: ModelInput, *, block_size: int, num_kv_blocks: int, max_positions: int,
                        max_gather_blocks: int | None, device: torch.device,
                        decode_kernel: Callable[..., None] | None = None) -> StepMetadata:
    """Flatten a ModelInput into tensors. Decodes go to `decode_kernel` when given, else are attended in
    chunks that gather at most `max_gather_blocks` blocks (K and V counted apart; None: one chunk). Raises
    ValueError for a malformed batch (an empty chunk, a position past the model's limit, a block table too
    short for its positions)."""
    if not batch.seqs:
        raise ValueError("a step needs at least one scheduled sequence")
    positions: list[int] = []
    tables: list[list[int]] = []  # per sequence: the blocks covering positions 0 .. end - 1
    sample_rows: list[int] = []
    for seq in batch.seqs:
        num_new = len(seq.token_ids)
        end = seq.start_pos + num_new
        if num_new == 0 or seq.start_pos < 0:
            raise ValueError(f"sequence {seq.seq_id}: empty chunk or negative start_pos {seq.start_pos}")
        if end > max_positions:
            raise ValueError(f"sequence {seq.seq_id}: position {end - 1} exceeds the model's limit "
                             f"of {max_positions} positions")
        num_blocks = -(-end // block_size)
        if len(seq.block_table) < num_blocks:
            raise ValueError(f"sequence {seq.seq_id}: {end} tokens need {num_blocks} blocks of "
                             f"{block_size}; the block table has {len(seq.block_table)}")
        tables.append(list(seq.block_table[:num_blocks]))
        positions.extend(range(seq.start_pos, end))
        if seq.sample:
            sample_rows.append(len(positions) - 1)

    # Slot of every token: its sequence's block for pos // block_size, then the offset inside the block.
    lengths = [len(seq.token_ids) for seq in batch.seqs]
    max_blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    slot_mapping = table[seq_of_token, pos // block_size] * block_size + pos % block_size

    decode_rows = [i for i, n in enumerate(lengths) if n == 1]
    token_starts = list(itertools.accumulate(lengths, initial=0))
    decode: DecodeGroup | KernelDecode | None = None
    if decode_rows:
        # When every sequence decodes, its rows are 0 .. n-1 and so are its tokens: no index to gather by.
        every_token = len(decode_rows) == len(batch.seqs)
        decode_tokens = None if every_token else torch.tensor([token_starts[i] for i in decode_rows], dtype=torch.int64)
        decode_pos = pos if every_token else pos[decode_tokens]
        decode_tables = table if every_token else table[decode_rows]
        if decode_kernel is not None:
            query_start = torch.arange(len(decode_rows) + 1, dtype=torch.int64)
            decode = KernelDecode(decode_tokens, decode_tables, query_start, decode_pos, decode_kernel)
        else:
            decode = _decode_group(decode_tokens, decode_tables, decode_pos, block_size, num_kv_blocks,
                                   max_gather_blocks, device)
    prefills = tuple(
        _prefill_chunk(seq, token_starts[i], tables[i], block_size, num_kv_blocks, device)
        for i, seq in enumerate(batch.seqs) if lengths[i] > 1
    )
    input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in batch.seqs)),
                             dtype=torch.int64)
    return StepMetadata(
        input_ids=input_ids.to(device, non_blocking=True),
        positions=pos.to(device, non_blocking=True),
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        sample_indices=torch.tensor(sample_rows, dtype=torch.int64).to(device, non_blocking=True),
        decode=decode,
        prefills=prefills,
    )


def _kv_block_ids(block_ids: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    flat = block_ids.reshape(-1)
    return torch.cat((flat, flat + num_kv_blocks))


def _decode_group(token_indices: torch.Tensor | None, tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                  num_kv_blocks: int, max_gather_blocks: int | None, device: torch.device) -> DecodeGroup:
    num_seqs = positions.numel()
    num_keys = positions + 1
    max_blocks = -(-int(num_keys.max()) // block_size)
    block_ids = tables[:, :max_blocks]
    key_mask = torch.arange(max_blocks * block_size)[None, :] < num_keys[:, None]
    per_chunk = num_seqs if max_gather_blocks is None else max(1, max_gather_blocks // (2 * max_blocks))
    chunks = tuple(
        DecodeChunk(start, min(start + per_chunk, num_seqs),
                    _kv_block_ids(block_ids[start:start + per_chunk], num_kv_blocks).to(device, non_blocking=True))
        for start in range(0, num_seqs, per_chunk)
    )
    return DecodeGroup(
        token_indices=None if token_indices is None else token_indices.to(device, non_blocking=True),
        chunks=chunks,
        num_seqs=num_seqs,
        max_blocks=max_blocks,
        key_mask=key_mask.view(num_seqs, 1, 1, -1).to(device, non_blocking=True),
    )


def _prefill_chunk(seq: ScheduledSeq, token_start: int, table: list[int], block_size: int, num_kv_blocks: int,
                   device: torch.device) -> PrefillChunk:
    num_new = len(seq.token_ids)
    num_keys = seq.start_pos + num_new
    if seq.start_pos == 0:
        return PrefillChunk(token_start, token_start + num_new, num_keys, None, None)
    query_pos = torch.arange(seq.start_pos, num_keys)
    mask = torch.arange(num_keys)[None, :] <= query_pos[:, None]
    block_ids = _kv_block_ids(torch.tensor(table, dtype=torch.int64), num_kv_blocks)
    return PrefillChunk(token_start, token_start + num_new, num_keys,
                        block_ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))


def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    meta: StepMetadata, cache: PagedKVCache) -> torch.Tensor:
    """Attention of one layer. query [num_tokens, heads, dim]; key, value [num_tokens, kv_heads, dim],
    rotary embeddings applied. Writes key/value into the cache, returns [num_tokens, heads, dim]."""
    cache.write(layer, key, value, meta.slot_mapping)
    decode = meta.decode
    if decode is not None and decode.token_indices is None and not meta.prefills:
        return _decode_attention(layer, query, decode, cache)
    out = torch.empty_like(query)
    if decode is not None:
        decode_query = query.index_select(0, decode.token_indices)
        out.index_copy_(0, decode.token_indices, _decode_attention(layer, decode_query, decode, cache))
    for chunk in meta.prefills:
        out[chunk.token_start:chunk.token_end] = _chunk_attention(layer, query, key, value, chunk, cache)
    return out


def _decode_attention(layer: int, query: torch.Tensor, decode: DecodeGroup | KernelDecode,
                      cache: PagedKVCache) -> torch.Tensor:
    if isinstance(decode, KernelDecode):
        return _kernel_attention(layer, query, decode, cache)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = cache.kv.shape[4]
    # [seqs, kv_heads, group, dim]: query heads h = kv_head * group + g, as in HF's repeat_kv.
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    grouped = grouped.to(cache.attention_dtype)
    if len(decode.chunks) == 1:
        return _decode_chunk(layer, grouped, decode, decode.chunks[0], cache).view(query.shape).to(query.dtype)
    out = torch.empty_like(grouped)
    for chunk in decode.chunks:
        out[chunk.seq_start:chunk.seq_end] = _decode_chunk(layer, grouped, decode, chunk, cache)
    return out.view(query.shape).to(query.dtype)


def _kernel_attention(layer: int, query: torch.Tensor, decode: KernelDecode, cache: PagedKVCache) -> torch.Tensor:
    # The kernel computes in float32 and takes the query's strides as they are (q is a view into the fused
    # q/k rotary output), so a float32 model hands it over without a copy.
    q = query if query.dtype == torch.float32 else query.float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    decode.kernel(out, q, cache.kv[layer], decode.block_tables, decode.query_start, decode.start_pos,
                  q.shape[-1] ** -0.5, 1)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _decode_chunk(layer: int, grouped: torch.Tensor, decode: DecodeGroup, chunk: DecodeChunk,
                  cache: PagedKVCache) -> torch.Tensor:
    rows = slice(chunk.seq_start, chunk.seq_end)
    query = grouped[rows]
    num_seqs, num_kv_heads, _, head_dim = query.shape
    keys, values = cache.gather(layer, chunk.kv_block_ids)  # [seqs * max_blocks, block, kv_heads, dim]
    keys = keys.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=decode.key_mask[rows])


def _chunk_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     chunk: PrefillChunk, cache: PagedKVCache) -> torch.Tensor:
    # SDPA wants [batch, heads, tokens, dim]; 3-D inputs fall back to the unfused math kernel on CPU
    # (1.4 s against 0.2 s for a 1024-token bfloat16 prefill of 12 layers).
    rows = slice(chunk.token_start, chunk.token_end)
    q = query[rows].transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != key.shape[1]
    if chunk.kv_block_ids is None:
        k, v = key[rows].transpose(0, 1).unsqueeze(0), value[rows].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    grouped = cache.kv.dtype == torch.bfloat16 and cache.kv.device.type == "cpu"
    keys, values = cache.gather(layer, chunk.kv_block_ids, upcast=not grouped)
    num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
    k = keys.reshape(-1, num_kv_heads, head_dim)[:chunk.num_keys]
    v = values.reshape(-1, num_kv_heads, head_dim)[:chunk.num_keys]
    if grouped:
        return _grouped_chunk_attention(query[rows].to(k.dtype), k, v, chunk).to(query.dtype)
    out = F.scaled_dot_product_attention(q.to(k.dtype), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                         attn_mask=chunk.mask, enable_gqa=gqa)
    return out[0].transpose(0, 1).to(query.dtype)


def _grouped_chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             chunk: PrefillChunk) -> torch.Tensor:
    """A chunk's attention over cached keys as three batched GEMM-like calls, bfloat16 on CPU: the query heads
    that share a KV head ride as rows of one matrix, so each KV head is one [group x chunk, keys] product, the
    mask an additive bias, the softmax over bfloat16 scores (computed in float32 inside, as HF's eager path does
    after its bfloat16 product). query [n, heads, dim]; keys, values [num_keys, kv_heads, dim]. For a 112-token
    chunk over 1,024 keys (SmolLM2, 9 heads on 3) it beat SDPA with a mask over the upcast blocks about 1.4x
    (`loadtests/bench_attention.py`); in float32 it was no faster than SDPA, which float32 keeps."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    grouped = query.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n,
                                                                                       head_dim)
    scores = torch.baddbmm(chunk.grouped_bias(group, query.dtype), grouped, keys.permute(1, 2, 0),
                           alpha=head_dim ** -0.5)
    out = torch.bmm(torch.softmax(scores, dim=-1), values.transpose(0, 1))
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
