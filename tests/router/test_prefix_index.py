"""The per-replica prefix index: LRU capacity, chain matching, correction from cached_tokens."""

from __future__ import annotations

import pytest

from kvgate.router.prefix_index import (CACHE_EVIDENCE_MIN, CACHE_EVIDENCE_WINDOW, DEFAULT_CAPACITY_CHUNKS,
                                        MAX_CAPACITY_CHUNKS, CachingJudgement, PrefixIndex, PrefixIndexes,
                                        capacity_chunks)
from kvgate.router.view import CacheFill


@pytest.mark.parametrize("blocks,block_size,chunk_chars,expected", [
    (1000, 16, 256, 250),  # 1,000 x 16 tokens x 4 chars = 64,000 chars = 250 chunks
    (64, 16, 64, 64),  # 64 x 16 x 4 = 4,096 chars = 64 chunks
    (10, 16, 1024, 0),  # 640 chars: not one full chunk
    (0, 16, 256, DEFAULT_CAPACITY_CHUNKS),  # a backend that reports no KV figures
    (1 << 26, 16, 256, MAX_CAPACITY_CHUNKS),  # an absurd figure: the cap, not an index that never evicts
])
def test_capacity_is_the_replicas_kv_cache_in_chunks(blocks: int, block_size: int, chunk_chars: int,
                                                     expected: int) -> None:
    assert capacity_chunks(blocks, block_size, chunk_chars) == expected


def test_match_length_counts_leading_hashes_and_stops_at_the_first_miss() -> None:
    index = PrefixIndex(capacity_chunks=10, chunk_chars=64)
    index.record((1, 2, 3))
    assert index.match_length((1, 2, 3, 4)) == 3
    assert index.match_length((1, 9, 3)) == 1  # 3 is held, but past a miss it cannot be a hit
    assert index.match_length((9, 1, 2)) == 0


def test_lru_forgets_the_oldest_chain_when_full() -> None:
    index = PrefixIndex(capacity_chunks=4, chunk_chars=64)
    index.record((1, 2))
    index.record((3, 4))
    index.record((5, 6))  # 6 entries > 4: chain (1, 2) goes
    assert len(index) == 4
    assert index.match_length((1, 2)) == 0
    assert index.match_length((3, 4)) == 2 and index.match_length((5, 6)) == 2


def test_eviction_trims_a_chain_from_its_tail() -> None:
    index = PrefixIndex(capacity_chunks=3, chunk_chars=64)
    index.record((1, 2, 3, 4, 5))  # root most recent: 4 and 5 evicted first
    assert index.match_length((1, 2, 3, 4, 5)) == 3


def test_recording_again_refreshes_a_chain() -> None:
    index = PrefixIndex(capacity_chunks=4, chunk_chars=64)
    index.record((1, 2))
    index.record((3, 4))
    index.record((1, 2))  # now (3, 4) is the oldest
    index.record((5, 6))
    assert index.match_length((1, 2)) == 2 and index.match_length((3, 4)) == 0


def test_the_working_set_is_what_a_later_chain_recorded_again_while_held() -> None:
    index = PrefixIndex(capacity_chunks=6, chunk_chars=64)
    index.record((1, 2, 3))  # a conversation's first turn
    index.record((7, 8))  # a question asked once
    assert index.cache_fill() == CacheFill(reused_chunks=0, capacity_chunks=6)
    index.record((1, 2, 3, 4))  # its next turn comes back for 1, 2, 3
    assert index.cache_fill().reused_chunks == 3
    index.record((9, 10))  # 8 entries > 6: the question goes, 8 then 7; the working set stays
    assert index.cache_fill().reused_chunks == 3 and index.match_length((7, 8)) == 0
    index.record((11, 12))  # two more go: the conversation's tail, 4 then 3
    assert index.match_length((1, 2, 3, 4)) == 2 and index.cache_fill().reused_chunks == 2


def test_resize_down_evicts_the_oldest() -> None:
    index = PrefixIndex(capacity_chunks=10, chunk_chars=64)
    index.record((1, 2))
    index.record((3, 4))
    index.resize(2)
    assert index.capacity == 2 and index.match_length((3, 4)) == 2 and index.match_length((1, 2)) == 0


def _not_caching(index: PrefixIndex, chain: tuple[int, ...]) -> None:
    """CACHE_EVIDENCE_MIN responses that were predicted a hit and realised nothing."""
    for _ in range(CACHE_EVIDENCE_MIN):
        index.record(chain)
        index.correct(chain, len(chain), 0)
    assert not index.caches()


@pytest.mark.parametrize("predicted,realised_tokens,dropped", [
    # chunk_chars 64 = 16 estimated tokens per chunk; chain of 5 recorded
    (4, 64, 0),  # 64 tokens = 4 chunks realised, as predicted
    (4, 60, 0),  # 60 tokens -> ceil(240 / 64) = 4 chunks: block rounding is not a miss
    (4, 0, 5),  # prefix caching off: the replica does not hold what it computed
    (0, 0, 0),  # nothing predicted, nothing to correct
])
def test_a_replica_that_does_not_cache_loses_what_it_missed(predicted: int, realised_tokens: int,
                                                             dropped: int) -> None:
    index = PrefixIndex(capacity_chunks=10, chunk_chars=64)
    _not_caching(index, (9,))
    chain = (1, 2, 3, 4, 5)
    index.record(chain)
    assert index.correct(chain, predicted, realised_tokens) == dropped
    assert index.match_length(chain) == 5 - dropped


@pytest.mark.parametrize("realised_tokens", [20, 0])
def test_a_caching_replica_keeps_a_chain_that_missed_since_the_miss_computed_it_again(realised_tokens: int) -> None:
    index = PrefixIndex(capacity_chunks=10, chunk_chars=64)
    chain = (1, 2, 3, 4, 5)
    index.record(chain)
    index.correct(chain, 5, 80)  # realised as predicted: it caches
    index.record(chain)
    assert index.correct(chain, 4, realised_tokens) == 0  # evicted, or another request was computing it
    assert index.match_length(chain) == 5
    assert index.stats().num_corrections_total == 1


def test_caching_is_assumed_until_enough_predicted_hits_realise_nothing_and_learnt_back() -> None:
    index = PrefixIndex(capacity_chunks=10, chunk_chars=64)
    chain = (1, 2)
    for _ in range(CACHE_EVIDENCE_MIN - 1):  # e.g. a burst on a new prompt, all prefilled together
        index.record(chain)
        assert index.correct(chain, 2, 0) == 0 and index.caches()
    index.record(chain)
    assert index.correct(chain, 2, 0) == 2 and not index.caches()
    index.record(chain)
    index.correct(chain, 2, 16)  # it caches again (prefix caching turned on)
    assert index.caches()
    index.correct(chain, 0, 0)  # a response with nothing predicted is no evidence either way
    assert index.caches()
    for _ in range(CACHE_EVIDENCE_WINDOW - 1):  # the hit stays in the window...
        index.correct(chain, 2, 0)
        assert index.caches()
    index.correct(chain, 2, 0)  # ...until it leaves it
    assert not index.caches()


def test_learn_returns_the_caching_judgement_only_when_an_answer_flips_it() -> None:
    indexes = PrefixIndexes(chunk_chars=64)
    chain = (1, 2)
    indexes.record("r1", chain)
    for _ in range(CACHE_EVIDENCE_MIN - 1):
        assert indexes.learn("r1", chain, 2, 0) is None  # still assumed to cache
    assert indexes.learn("r1", chain, 2, 0) == CachingJudgement(False, CACHE_EVIDENCE_MIN)
    assert indexes.learn("r1", chain, 2, 0) is None  # judged already: said once
    assert indexes.learn("r1", chain, 2, 16) == CachingJudgement(True, CACHE_EVIDENCE_MIN + 2)
    assert indexes.get("r1").stats().realised_cached_tokens_total == 16  # and corrected as `correct` does
    assert indexes.learn("gone", chain, 2, 0) is None  # a replica forgotten meanwhile


def test_correct_keeps_predicted_vs_realised_counters() -> None:
    index = PrefixIndex(capacity_chunks=10, chunk_chars=64)
    index.record((1, 2, 3))
    index.correct((1, 2, 3), 3, 48)  # predicted 3 x 16 = 48 tokens, realised 48
    index.correct((1, 2, 3), 3, 16)  # predicted 48, realised 16: a correction
    stats = index.stats()
    assert (stats.predicted_cached_tokens_total, stats.realised_cached_tokens_total) == (96, 64)
    assert stats.num_corrections_total == 1 and stats.num_entries == 3


def test_indexes_answer_per_replica_and_forget_a_replica() -> None:
    indexes = PrefixIndexes(chunk_chars=64)
    indexes.ensure("r1", kv_blocks_total=64, block_size_tokens=16)  # 64 chunks
    indexes.record("r1", (1, 2))
    assert indexes.match_length("r1", (1, 2)) == 2
    assert indexes.match_length("r2", (1, 2)) == 0  # never seen: no match, no error
    indexes.forget_replica("r1")
    indexes.forget_replica("r1")  # idempotent
    assert indexes.match_length("r1", (1, 2)) == 0


def test_ensure_resizes_to_a_new_kv_capacity() -> None:
    indexes = PrefixIndexes(chunk_chars=64)
    indexes.ensure("r1", 64, 16)
    indexes.record("r1", tuple(range(10)))
    index = indexes.ensure("r1", 4, 16)  # 4 x 16 x 4 / 64 = 4 chunks
    assert index.capacity == 4 and indexes.match_length("r1", tuple(range(10))) == 4


def test_each_replica_index_counts_in_its_own_chunk_size() -> None:
    indexes = PrefixIndexes(chunk_chars=256)
    small = indexes.ensure("r64", 64, 16, chunk_chars=64)  # 64 x 16 x 4 / 64 = 64 chunks
    default = indexes.ensure("r256", 64, 16)  # 64 x 16 x 4 / 256 = 16 chunks
    assert (small.capacity, small.chunk_chars) == (64, 64)
    assert (default.capacity, default.chunk_chars) == (16, 256)
    small.record((1, 2, 3, 4))
    # 20 tokens x 4 chars = 80 chars: ceil(80 / 64) = 2 chunks realised, where 256-char chunks round
    # the same 20 tokens up to 1 of 1: a shortfall in one, none in the other
    assert indexes.correct("r64", (1, 2, 3, 4), 4, 20) == 0 and small.stats().num_corrections_total == 1
    default.record((5,))
    assert indexes.correct("r256", (5,), 1, 20) == 0 and default.stats().num_corrections_total == 0


def test_a_new_chunk_size_starts_the_replica_index_afresh() -> None:
    indexes = PrefixIndexes(chunk_chars=64)
    indexes.ensure("r1", 64, 16, chunk_chars=64)
    indexes.record("r1", (1, 2))
    index = indexes.ensure("r1", 64, 16, chunk_chars=128)  # hashes of another cut never match
    assert index.chunk_chars == 128 and index.capacity == 32 and len(index) == 0


def test_capacity_follows_the_learnt_chars_per_token() -> None:
    # 1,000 blocks x 16 tokens: 64,000 chars at 4 chars per token (250 chunks of 256), but only
    # 24,000 chars at tiny-llama's 1.5 (93 chunks): believing 4 would predict hits the engine evicted.
    assert capacity_chunks(1000, 16, 256) == 250
    assert capacity_chunks(1000, 16, 256, chars_per_token=1.5) == 93
    indexes = PrefixIndexes(256)
    assert indexes.ensure("r", 1000, 16, 256, chars_per_token=1.5).capacity == 93
