"""The KV block pool and prefix cache: block math, the hash chain, hits, eviction order, ref counts,
counters and KV events. All numbers use block_size 16 unless a test says otherwise."""

from __future__ import annotations

import pytest

from kvgate.engine.block_manager import (ROOT_BLOCK_HASH, BlockManager, BlockRemoved, BlockStored,
                                  OutOfBlocksError, hash_block, hash_blocks)
from kvgate.engine.sequence import SamplingParams, Sequence

BS = 16


def make_seq(seq_id: int, tokens, adapter: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=tuple(tokens), params=SamplingParams(), adapter=adapter)


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a sequence whose whole prompt fits one step: attach the cached
    prefix, allocate the rest, 'compute' it, commit the full blocks. Returns the cached token count."""
    cached = bm.allocate_prefix(seq)
    seq.num_computed_tokens = cached
    num_new = seq.num_tokens - cached
    assert bm.can_allocate(seq, num_new)
    bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.commit_full_blocks(seq)
    return cached


# ----- block math


def test_a_40_token_prompt_takes_3_blocks_of_which_2_are_full_and_cached() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(1, range(40))
    assert prefill(bm, seq) == 0
    # 40 tokens = 16 + 16 + 8: blocks 0, 1 full, block 2 holds 8 tokens and stays uncached.
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    assert [bm.block_hash(b) for b in seq.block_table] == [*hash_blocks(range(40), BS), None]
    assert bm.num_cached_blocks == 2


def test_allocate_grows_the_table_only_when_a_block_boundary_is_crossed() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(1, range(16))
    bm.allocate(seq, 16)
    seq.num_computed_tokens = 16
    bm.allocate(seq, 0)
    assert len(seq.block_table) == 1
    bm.allocate(seq, 1)  # position 16 opens block 2
    assert len(seq.block_table) == 2


def test_allocate_without_room_raises_and_can_allocate_says_no_first() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(1, range(40))
    assert not bm.can_allocate(seq, 40)  # needs 3 blocks, 2 exist
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks; 2 of 2 are free"):
        bm.allocate(seq, 40)
    assert seq.block_table == [] and bm.num_free_blocks == 2


# ----- the hash chain


def test_hash_chain_is_deterministic_and_chained() -> None:
    tokens = list(range(100, 140))
    chain = hash_blocks(tokens, BS)
    assert len(chain) == 2  # the 8-token tail has no hash
    assert chain == hash_blocks(tuple(tokens), BS)
    assert chain[0] == hash_block(ROOT_BLOCK_HASH, tokens[:16], None)
    assert chain[1] == hash_block(chain[0], tokens[16:32], None)
    # Pinned values: the router reimplements this chain, so they must never change silently.
    assert ROOT_BLOCK_HASH == 3004005699297323702  # xxh64(b"kvgate/prefix-cache/v1")
    assert hash_block(ROOT_BLOCK_HASH, [1, 2, 3], None) == 2753118387338153848


def test_a_block_hash_depends_on_every_earlier_token() -> None:
    a = hash_blocks([0] * 32, BS)
    b = hash_blocks([1] + [0] * 31, BS)
    assert a[0] != b[0] and a[1] != b[1]  # same second-block tokens, different parent


def test_adapters_never_share_blocks() -> None:
    tokens = list(range(32))
    assert hash_blocks(tokens, BS, "sql") != hash_blocks(tokens, BS, "chat")
    assert hash_blocks(tokens, BS, None) == hash_blocks(tokens, BS, "")
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefill(bm, make_seq(1, range(40), adapter="sql"))
    assert prefill(bm, make_seq(2, range(40), adapter="chat")) == 0
    assert prefill(bm, make_seq(3, range(40), adapter="sql")) == 32


# ----- prefix hits and the last-token rule


def test_a_second_sequence_with_the_same_40_token_prefix_gets_32_cached_tokens() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    first = make_seq(1, range(40))
    prefill(bm, first)
    second = make_seq(2, [*range(40), 999, 998])  # 42 tokens: 2 full blocks shared
    assert prefill(bm, second) == 32
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] not in first.block_table


@pytest.mark.parametrize("num_tokens,cached", [
    (40, 32),  # 2 full blocks hit; tokens 32..39 computed
    (33, 32),  # 2 full blocks hit; only token 32 computed
    (32, 16),  # both blocks are cached, but at most (32 - 1) // 16 = 1 block is served
    (17, 16),
    (16, 0),  # a one-block prompt is always computed
])
def test_the_last_known_token_is_always_computed_and_hits_are_whole_blocks(num_tokens, cached) -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefill(bm, make_seq(1, range(48)))  # 3 full blocks cached
    seq = make_seq(2, range(num_tokens))
    assert bm.allocate_prefix(seq) == cached
    assert len(seq.block_table) == cached // BS


def test_a_resumed_sequence_looks_up_its_generated_tokens_too() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(1, range(20))
    prefill(bm, seq)
    seq.output_token_ids.extend(range(500, 514))  # 34 tokens; KV computed for 33 of them
    bm.allocate(seq, 13)
    seq.num_computed_tokens = 33
    bm.commit_full_blocks(seq)  # block 1 (tokens 16..31, 4 prompt + 12 generated) becomes cached
    bm.free(seq)
    seq.num_computed_tokens = 0  # preempted; on resume the cache serves 2 blocks
    assert bm.allocate_prefix(seq) == 32


def test_a_partial_block_is_not_cached_until_it_is_full_and_computed() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(1, range(20))
    seq.output_token_ids.extend(range(12))  # 32 known tokens
    bm.allocate(seq, 31)
    seq.num_computed_tokens = 31  # token 31 is known but its KV is not computed yet
    bm.commit_full_blocks(seq)
    assert bm.num_cached_blocks == 1
    bm.allocate(seq, 1)
    seq.num_computed_tokens = 32
    bm.commit_full_blocks(seq)
    assert bm.num_cached_blocks == 2


def test_prefix_caching_off_serves_nothing_and_hashes_nothing() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    prefill(bm, make_seq(1, range(40)))
    assert prefill(bm, make_seq(2, range(40))) == 0
    assert bm.num_cached_blocks == 0


# ----- ref counts, freeing and eviction


def test_two_sequences_sharing_a_prefix_share_ref_counted_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    a, b = make_seq(1, range(40)), make_seq(2, range(40))
    prefill(bm, a)
    prefill(bm, b)
    shared = a.block_table[:2]
    assert [bm.ref_count(x) for x in shared] == [2, 2]
    assert bm.num_free_blocks == 10 - 4  # 2 shared + 2 private tails
    bm.free(a)
    assert [bm.ref_count(x) for x in shared] == [1, 1]
    assert bm.num_free_blocks == 7  # only a's tail came back
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0


def test_free_is_idempotent() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(1, range(20))
    prefill(bm, seq)
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == []


def test_freed_blocks_keep_their_hash_and_are_revived_on_a_hit() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = make_seq(1, range(40))
    prefill(bm, first)
    kept = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    second = make_seq(2, range(40))
    assert prefill(bm, second) == 32
    assert second.block_table[:2] == kept  # the same physical blocks, no recomputation
    assert [bm.ref_count(x) for x in kept] == [1, 1]


def test_eviction_takes_uncached_blocks_first_then_tails_before_parents() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq(1, range(40))  # blocks 0, 1 cached, 2 partial
    prefill(bm, a)
    bm.free(a)  # released tail first: 2 (no hash) to the plain list; 1 then 0 to the cached LRU
    assert bm.free_block_ids() == [3, 4, 5, 2, 1, 0]
    b = make_seq(2, range(1000, 1080))  # 80 new tokens: 5 blocks
    bm.allocate(b, 80)
    assert b.block_table == [3, 4, 5, 2, 1]  # block 1 (a's tail) evicted, its parent 0 survives
    assert bm.num_cached_blocks == 1
    assert bm.allocate_prefix(make_seq(3, range(40))) == 16


def test_least_recently_freed_cached_blocks_are_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_seq(1, range(0, 16)), make_seq(2, range(100, 116))
    a.output_token_ids.append(7)
    b.output_token_ids.append(7)
    prefill(bm, a)
    prefill(bm, b)  # a holds 0, 1; b holds 2, 3; blocks 0 and 2 cached
    bm.free(a)
    bm.free(b)
    assert bm.free_block_ids() == [1, 3, 0, 2]  # plain first, then a's block (freed earlier)
    c = make_seq(3, range(200, 248))
    bm.allocate(c, 48)
    assert c.block_table == [1, 3, 0]
    assert bm.allocate_prefix(make_seq(4, range(100, 117))) == 16  # b's block survived


def test_reset_prefix_cache_drops_only_free_cached_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    kept, dropped = make_seq(1, range(40)), make_seq(2, range(100, 140))
    prefill(bm, kept)
    prefill(bm, dropped)
    bm.free(dropped)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 2  # kept's blocks are in use and stay cached
    assert prefill(bm, make_seq(3, range(100, 140))) == 0
    assert prefill(bm, make_seq(4, range(40))) == 32


def test_a_duplicate_computed_block_is_not_cached_twice() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(1, range(20)), make_seq(2, range(20))
    for seq in (a, b):  # both admitted before either committed: both miss
        assert bm.allocate_prefix(seq) == 0
        bm.allocate(seq, 20)
        seq.num_computed_tokens = 20
    bm.commit_full_blocks(a)
    bm.commit_full_blocks(b)
    assert bm.cached_block_hashes() == [bm.block_hash(a.block_table[0])]  # the first one wins
    assert bm.block_hash(b.block_table[0]) is None  # b's copy stays plain and is freed as such


# ----- counters and KV events


def test_prefix_query_counters_accumulate() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.record_prefix_query(40, 0)
    bm.record_prefix_query(42, 32)
    assert (bm.queried_tokens_total, bm.hit_tokens_total) == (82, 32)


def test_kv_events_report_stored_runs_with_parents_and_removals() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, enable_kv_events=True)
    seq = make_seq(1, range(40), adapter="sql")
    chain = hash_blocks(range(40), BS, "sql")
    bm.allocate(seq, 20)
    seq.num_computed_tokens = 20  # chunk 1 fills block 0
    bm.commit_full_blocks(seq)
    bm.allocate(seq, 20)
    seq.num_computed_tokens = 40  # chunk 2 fills block 1
    bm.commit_full_blocks(seq)
    assert bm.drain_kv_events() == [BlockStored((chain[0],), None, "sql", BS),
                                    BlockStored((chain[1],), chain[0], "sql", BS)]
    assert bm.drain_kv_events() == []
    assert sorted(bm.cached_block_hashes()) == sorted(chain)
    bm.free(seq)
    other = make_seq(2, range(100, 148))
    bm.allocate(other, 48)  # 3 blocks: the plain one, then the tail chain[1], then chain[0]
    assert bm.drain_kv_events() == [BlockRemoved((chain[1],)), BlockRemoved((chain[0],))]
    assert bm.cached_block_hashes() == []


def test_kv_events_are_off_by_default() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    prefill(bm, make_seq(1, range(40)))
    assert bm.drain_kv_events() == []


def test_constructor_rejects_empty_pools() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=1, block_size=0)
