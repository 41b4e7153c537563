"""The KV block hash chain: how a prompt's token ids name the prefix-cache blocks that hold them.

A shared leaf, because it is a protocol: the engine keys its prefix cache by these hashes and reports
them in `KvBlocksStored` / `KvBlocksRemoved` events (proto/kvgate/v1/replica.proto), and the gateway
computes the same chain over a request's prompt to find which replica holds how much of it. Changing a
byte here changes every hash: bump ROOT_BLOCK_HASH's tag so old and new never match by accident.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as TokenIds

import xxhash

# The parent of a sequence's first block. Fixed forever: the router computes the same chain.
ROOT_BLOCK_HASH = xxhash.xxh64_intdigest(b"kvgate/prefix-cache/v1")


def hash_block(parent_hash: int, token_ids: TokenIds[int], adapter: str | None) -> int:
    """The chained hash of one full block: xxh64 (seed 0) over these bytes, all little-endian:
    the parent hash (u64; ROOT_BLOCK_HASH for a first block), the number of tokens (u32), each
    token id (u32), then the adapter name in UTF-8 ("" for the base model).

    The adapter is in every block's hash, so the same text under two adapters never shares KV.
    Raises struct.error for a token id outside 0..2**32-1.
    """
    count = len(token_ids)
    data = struct.pack(f"<QI{count}I", parent_hash, count, *token_ids) + (adapter or "").encode()
    return xxhash.xxh64_intdigest(data)


def hash_blocks(token_ids: TokenIds[int], block_size: int, adapter: str | None = None) -> list[int]:
    """The chain of hashes of every full block of `token_ids` (a partial tail block has none).

    Pure and deterministic, so the router can compute the same chain to find a replica that holds a
    prompt's prefix: block 16, 40 tokens -> 2 hashes (tokens 0..15 and 16..31)."""
    if block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
    hashes: list[int] = []
    parent = ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], adapter)
        hashes.append(parent)
    return hashes
