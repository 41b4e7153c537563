"""The paged KV cache: fixed-size blocks of key/value vectors that sequences address through block tables.

Layout: one tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. A token at
position `pos` of a sequence lives in slot `block_table[pos // block_size] * block_size + pos % block_size`
of every layer. Blocks are shared freely between sequences (prefix caching): the runner never owns them,
the scheduler's block manager does.

Attention reads a sequence's keys by gathering its blocks into a contiguous workspace. The workspace is
allocated once and reused by every layer and step (gathering into a fresh tensor measured 9.7 ms against
1.4 ms into a preallocated one); it only grows, by doubling, when a step needs more blocks than it holds.
"""

from __future__ import annotations

import torch

# A decode chunk's gathered K and V on CPU: small enough to stay in a 32 MiB last-level cache next to the
# weights streaming through it, large enough that the per-chunk Python overhead stays small.
CPU_GATHER_CHUNK_BYTES = 8 << 20


def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V. Worked example: 12 layers, 16 tokens,
    12 heads of 64, float32 -> 12 * 2 * 16 * 12 * 64 * 4 = 1,179,648 bytes (1.125 MiB)."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_bytes


class PagedKVCache:
    """Every layer's K and V blocks, plus the gather workspace attention reads them through."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 initial_workspace_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        # Per layer: [2 * num_blocks, block_size, heads, dim], K blocks then V blocks, so one index_select
        # with (block ids, block ids + num_blocks) gathers both.
        self._blocks = [self.kv[layer].view(2 * num_blocks, block_size, num_kv_heads, head_dim)
                        for layer in range(num_layers)]
        # Per layer: [2, num_blocks * block_size, heads, dim], for writes by slot.
        self._slots = [self.kv[layer].view(2, num_blocks * block_size, num_kv_heads, head_dim)
                       for layer in range(num_layers)]
        # On CPU, half-precision SDPA is several times slower than float32 over the same data (3.7 ms
        # against 0.7 ms for 16 sequences of 272 keys, 12 heads of 64), so attention upcasts the gathered
        # blocks into a float32 twin of the workspace (a bfloat16 prefill chunk reads them as they are:
        # `attention._grouped_chunk_attention`).
        self.attention_dtype = torch.float32 if device.type == "cpu" else dtype
        # How many blocks (K and V counted apart) one decode chunk gathers; None gathers all at once. On CPU
        # a chunk's workspace (~8 MiB) stays in the last-level cache between the gather and the attention.
        self.max_gather_blocks: int | None = None
        if device.type == "cpu":
            element_bytes = torch.empty((), dtype=self.attention_dtype).element_size()
            block_bytes = block_size * num_kv_heads * head_dim * element_bytes  # one layer, K or V
            self.max_gather_blocks = max(2, CPU_GATHER_CHUNK_BYTES // block_bytes)
        self._workspace = self._new_workspace(max(1, initial_workspace_blocks))
        self._workspace_f32: torch.Tensor | None = None

    @property
    def workspace_blocks(self) -> int:
        """Blocks (K and V counted apart) the gather workspace holds now."""
        return self._workspace.shape[0]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's new keys and values ([num_tokens, heads, dim]) at their slots."""
        slots = self._slots[layer]
        slots[0].index_copy_(0, slot_mapping, key)
        slots[1].index_copy_(0, slot_mapping, value)

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks, every layer's K and V: (source, destination) pairs (copy on write of a fork)."""
        if not copies:
            return
        sources = torch.tensor([s for s, _ in copies], device=self.kv.device)
        dests = torch.tensor([d for _, d in copies], device=self.kv.device)
        self.kv.index_copy_(2, dests, self.kv.index_select(2, sources))

    def gather(self, layer: int, kv_block_ids: torch.Tensor,
               upcast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks into the workspace and return (keys, values), each [n, block_size, heads, dim] in
        `attention_dtype` (in the cache's own dtype with `upcast` false). `kv_block_ids` is (block ids, block
        ids + num_blocks) concatenated, n each.

        The result aliases the workspace: it is valid until the next gather."""
        count = kv_block_ids.numel()
        half = count // 2
        if count > self._workspace.shape[0]:
            self._workspace = self._new_workspace(max(count, 2 * self._workspace.shape[0]))
        out = self._workspace[:count]
        torch.index_select(self._blocks[layer], 0, kv_block_ids, out=out)
        if upcast and out.dtype != self.attention_dtype:
            if self._workspace_f32 is None or self._workspace_f32.shape[0] < self._workspace.shape[0]:
                self._workspace_f32 = torch.empty(self._workspace.shape, dtype=self.attention_dtype,
                                                  device=out.device)
            out = self._workspace_f32[:count].copy_(out)
        return out[:half], out[half:]

    def _new_workspace(self, num_blocks: int) -> torch.Tensor:
        _, _, _, block_size, heads, dim = self.kv.shape
        return torch.empty(num_blocks, block_size, heads, dim, dtype=self.kv.dtype, device=self.kv.device)
