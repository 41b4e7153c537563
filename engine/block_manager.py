"""The paged KV block pool and its automatic prefix cache (modelled on nano-vllm and vLLM v1).

The pool holds `num_blocks` fixed-size blocks (ids 0..num_blocks-1); each holds the KV of `block_size`
consecutive positions of one sequence. A sequence's `block_table` lists its physical blocks in position
order, so position p lives in block_table[p // block_size], slot p % block_size.

Prefix caching rules (the exact contract; tests/engine/test_block_manager.py holds worked numbers):

* What is cached: every FULL block whose KV has been computed, prompt or generated tokens alike, keyed
  by a chained 64-bit hash (`hash_block`). A block is registered by `commit_full_blocks` once
  num_computed_tokens covers it, never earlier. If its hash is already registered (two sequences
  computed the same prefix at once), the first block stays the cached one and the copy is not cached.
* Lookup (`allocate_prefix`): the longest run of leading full blocks of the sequence's known tokens
  whose chained hashes hit. The last known token is always computed, because computing it is what
  yields the logits for the next token, and the hit is whole blocks only: at most
  (num_tokens - 1) // block_size blocks are served. Block 16: a 40-token prompt serves at most 32
  tokens, a 33-token prompt 32, and a fully cached 32-token prompt only 16 (as vLLM v1): serving 31
  would mean writing position 31's KV into the second cached block, which other sequences may share,
  and there is no copy-on-write.
* Blocks being computed: a sequence that attaches its prefix claims the hashes of its known full blocks
  past the hit, until it commits them or is freed. `prefix_computing_elsewhere` tells the scheduler
  that the next block a sequence needs is claimed by another, running one, so it can wait a step and
  hit that block instead of computing it a second time (SGLang defers such requests within a batch).
* Freeing: ref counts drop; a block at zero keeps its hash (and stays findable) if it is cached,
  and joins the free list. A later hit revives it without recomputation. A sequence's blocks are
  released tail first, so a sequence's last block is evicted before its parents, whose hashes more
  sequences are likely to share.
* Eviction (`allocate` needs fresh blocks): first a free block that holds no cached hash (FIFO), else
  the least recently freed cached block, whose hash is dropped (a BlockRemoved event).

Hash collisions: two different prefixes with the same 64-bit chained hash would share KV. With a
million cached blocks the chance is about n^2 / 2^65 ~ 3e-8; we accept it, as vLLM did for years.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvgate.engine.sequence import Sequence
from kvgate.kv_blocks import ROOT_BLOCK_HASH, hash_block, hash_blocks  # noqa: F401  (re-exported)

@dataclass(frozen=True)
class BlockStored:
    """Blocks that joined the prefix cache: a run of consecutive blocks of one sequence's chain."""

    block_hashes: tuple[int, ...]  # in chain order
    parent_hash: int | None  # hash of the block before the first one; None when it is a first block
    adapter: str | None
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks whose hashes left the prefix cache (evicted for reuse, or the cache was reset)."""

    block_hashes: tuple[int, ...]


KVEvent = BlockStored | BlockRemoved


class OutOfBlocksError(RuntimeError):
    """`allocate` was called without a successful `can_allocate` first."""


class BlockManager:
    """A pool of KV blocks with ref counts, per-sequence block tables and automatic prefix caching.

    Checks are split from actions: `can_allocate` then `allocate`. Everything is synchronous and
    plain Python; the scheduler owns the only instance of a replica.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1; got {num_blocks!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_kv_events = enable_kv_events
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[int | None] = [None] * num_blocks  # set while the block is cached
        self._cached: dict[int, int] = {}  # hash -> block id, for blocks in use and free alike
        # Free blocks, in eviction order: those without a hash first, then cached ones, least
        # recently freed first (an OrderedDict used as an ordered set).
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # How many leading full blocks of each sequence are committed (or were cache hits), by seq_id; their
        # hashes are the first entries of seq.block_hashes.
        self._seq_num_chained: dict[int, int] = {}
        # Full blocks an admitted sequence will compute and has not yet: hash -> the claiming seq_id.
        self._computing: dict[int, int] = {}
        self._events: list[KVEvent] = []
        self.queried_tokens_total = 0  # prompt tokens looked up on sequences' first schedule
        self.hit_tokens_total = 0  # of which served from the prefix cache

    # ----- counters

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user: never used, or freed (cached ones included; they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered, in use or free."""
        return len(self._cached)

    @property
    def num_claimed_blocks(self) -> int:
        """Full blocks that admitted sequences will compute and have not yet (see `prefix_computing_elsewhere`)."""
        return len(self._computing)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one sequence's first lookup. The scheduler calls it once the admission sticks, so a
        sequence that waits for blocks and retries is counted once."""
        self.queried_tokens_total += num_queried_tokens
        self.hit_tokens_total += num_hit_tokens

    # ----- introspection (metrics, tests)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The block's registered prefix-cache hash, or None."""
        return self._block_hashes[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order `allocate` takes them."""
        return [*self._free_plain, *self._free_cached]

    def cached_block_hashes(self) -> list[int]:
        """Every hash in the cache now: the snapshot a fresh KV-event subscriber starts from.
        Events drained after it may repeat what it holds; subscribers apply them as set updates."""
        return list(self._cached)

    def drain_kv_events(self) -> list[KVEvent]:
        """Events recorded since the last drain, oldest first (always empty unless enable_kv_events).
        The owner drains every step, so the list stays short."""
        events, self._events = self._events, []
        return events

    # ----- allocation

    def allocate_prefix(self, seq: Sequence) -> int:
        """Attach the cached prefix of a sequence that holds no blocks (first schedule or resumed
        after preemption): bump ref counts, revive free cached blocks, return the cached token count
        (a multiple of block_size; 0 with prefix caching off). Does not set num_computed_tokens.
        Raises ValueError if the sequence already holds blocks."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds {len(seq.block_table)} blocks")
        hits = self._lookup(seq)
        for _, block in hits:
            if self._ref_counts[block] == 0:
                del self._free_cached[block]
            self._ref_counts[block] += 1
            seq.block_table.append(block)
        self._seq_num_chained[seq.seq_id] = len(hits)
        for block_hash in seq.block_hashes[len(hits):]:
            if block_hash not in self._cached:
                self._computing.setdefault(block_hash, seq.seq_id)
        return len(hits) * self.block_size

    def prefix_computing_elsewhere(self, seq: Sequence) -> bool:
        """Whether the first full block of `seq` (which holds no blocks) that the cache misses is claimed by
        a sequence that has not computed it yet. The scheduler retries such a sequence next step."""
        if not self._computing or seq.block_table:
            return False  # nothing is being computed (or prefix caching is off: nothing is ever claimed)
        hashes = self._full_block_hashes(seq)
        num_hits = len(self._lookup(seq))
        return num_hits < len(hashes) and hashes[num_hits] in self._computing

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free pool can extend `seq` to cover num_computed_tokens + num_new_tokens."""
        return self._num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to cover positions 0 .. num_computed_tokens + num_new_tokens - 1.
        Block 16, 0 computed, 40 new -> 3 blocks. Raises OutOfBlocksError if `can_allocate` is false."""
        needed = self._num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed} blocks; "
                                   f"{self.num_free_blocks} of {self.num_total_blocks} are free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def can_fork(self, parent: Sequence) -> bool:
        """Whether `fork(parent, ...)` would find the block its copy on write needs."""
        return parent.num_computed_tokens % self.block_size == 0 or self.num_free_blocks >= 1

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (holding no blocks) the parent's computed blocks: the full ones shared (ref counts up),
        a partly filled last one copied on write: the child gets a fresh block and the (source, destination)
        pair whose KV the runner must copy before the child writes into it. None when nothing needs a copy.
        Worked numbers, block 16: a 40-token prompt shares 2 blocks and copies the third; a 32-token prompt
        shares both and copies nothing. Raises OutOfBlocksError when `can_fork` is false."""
        if child.block_table:
            raise ValueError(f"sequence {child.seq_id} already holds {len(child.block_table)} blocks")
        if not self.can_fork(parent):
            raise OutOfBlocksError(f"forking sequence {parent.seq_id} needs a free block; none is")
        num_blocks = -(-parent.num_computed_tokens // self.block_size)
        shared = parent.block_table[:num_blocks]
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table[:] = shared
        child.block_hashes[:] = parent.block_hashes[:parent.num_computed_tokens // self.block_size]
        self._seq_num_chained[child.seq_id] = min(self._seq_num_chained.get(parent.seq_id, 0),
                                                  len(child.block_hashes))
        if parent.num_computed_tokens % self.block_size == 0:
            return None
        source = child.block_table[-1]
        self._ref_counts[source] -= 1  # still held by the parent
        child.block_table[-1] = self._take_free_block()
        return source, child.block_table[-1]

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks at once, tail first. Idempotent."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if self._block_hashes[block] is None:
                self._free_plain.append(block)
            else:
                self._free_cached[block] = None
        seq.block_table.clear()
        for block_hash in seq.block_hashes[self._seq_num_chained.pop(seq.seq_id, 0):]:
            self._unclaim(block_hash, seq.seq_id)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register in the prefix cache each block of `seq` that is full and whose KV is computed
        (per seq.num_computed_tokens). Call after every step for every sequence that advanced."""
        if not self.enable_prefix_caching:
            return
        num_chained = self._seq_num_chained.get(seq.seq_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= num_chained:
            return
        chain = self._full_block_hashes(seq)
        self._seq_num_chained[seq.seq_id] = num_full
        stored: list[int] = []  # indices of blocks that joined the cache
        for index in range(num_chained, num_full):
            block_hash = chain[index]
            self._unclaim(block_hash, seq.seq_id)
            if block_hash in self._cached:
                continue  # the same content is cached in another block already
            block = seq.block_table[index]
            self._cached[block_hash] = block
            self._block_hashes[block] = block_hash
            stored.append(index)
        if self.enable_kv_events and stored:
            self._record_stored(seq, chain, stored)

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all free cached blocks (blocks in use keep theirs). Returns how many."""
        dropped = [self._forget(block) for block in self._free_cached]
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        if self.enable_kv_events and dropped:
            self._events.append(BlockRemoved(tuple(dropped)))
        return len(dropped)

    # ----- internals

    def _lookup(self, seq: Sequence) -> list[tuple[int, int]]:
        """(hash, block id) of the leading cached full blocks, at most (num_tokens - 1) // block_size."""
        if not self.enable_prefix_caching:
            return []
        hits: list[tuple[int, int]] = []
        for block_hash in self._full_block_hashes(seq)[:(seq.num_tokens - 1) // self.block_size]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append((block_hash, block))
        return hits

    def _full_block_hashes(self, seq: Sequence) -> list[int]:
        """seq.block_hashes, first extended to every full block of its known tokens."""
        hashes = seq.block_hashes
        num_full = seq.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens = seq.all_token_ids
            parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
            for index in range(len(hashes), num_full):
                start = index * self.block_size
                parent = hash_block(parent, tokens[start:start + self.block_size], seq.adapter)
                hashes.append(parent)
        return hashes

    def _unclaim(self, block_hash: int, seq_id: int) -> None:
        if self._computing.get(block_hash) == seq_id:
            del self._computing[block_hash]

    def _num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_positions = seq.num_computed_tokens + num_new_tokens
        return max(0, math.ceil(num_positions / self.block_size) - len(seq.block_table))

    def _take_free_block(self) -> int:
        if self._free_plain:
            block = self._free_plain.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            evicted = self._forget(block)
            if self.enable_kv_events:
                self._events.append(BlockRemoved((evicted,)))
        self._ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> int:
        block_hash = self._block_hashes[block]
        assert block_hash is not None, "only cached blocks sit in the cached free list"
        del self._cached[block_hash]
        self._block_hashes[block] = None
        return block_hash

    def _record_stored(self, seq: Sequence, chain: list[int], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks, each naming its parent."""
        run_start = 0
        for i in range(1, len(stored) + 1):
            if i < len(stored) and stored[i] == stored[i - 1] + 1:
                continue
            first, last = stored[run_start], stored[i - 1]
            parent = chain[first - 1] if first > 0 else None
            self._events.append(BlockStored(tuple(chain[first:last + 1]), parent, seq.adapter,
                                            self.block_size))
            run_start = i
