"""The exact per-replica index fed by engines' KV block events, and requests hashed into KV blocks."""

from __future__ import annotations

import pytest

from kvgate.kv_blocks import hash_blocks
from kvgate.router.block_index import BlockIndexes, KvCleared, KvRemoved, KvStored
from kvgate.router.features import build_route_request
from kvgate.router.policies import Reason, RoutingKnobs, cache_aware
from kvgate.router.view import CacheFill, ReplicaState, ReplicaView

CHAIN = tuple(hash_blocks(list(range(64)), 16))  # 4 blocks


def synced(indexes: BlockIndexes, replica_id: str, *hashes: int) -> None:
    indexes.apply(replica_id, [KvCleared(), KvStored(tuple(hashes))], capacity_blocks=100)


def test_events_say_what_a_replica_holds_and_a_match_stops_at_the_first_miss() -> None:
    indexes = BlockIndexes()
    assert indexes.match_length("a", CHAIN) == 0  # never heard of
    synced(indexes, "a", *CHAIN[:3])
    assert indexes.match_length("a", CHAIN) == 3
    indexes.apply("a", [KvRemoved((CHAIN[1],))], capacity_blocks=100)
    assert indexes.match_length("a", CHAIN) == 1  # block 2 is still there, but unreachable past the gap
    indexes.apply("a", [KvCleared()], capacity_blocks=100)
    assert indexes.match_length("a", CHAIN) == 0


def test_an_index_says_nothing_until_its_stream_resyncs_and_after_it_drops() -> None:
    indexes = BlockIndexes()
    indexes.apply("a", [KvStored(CHAIN)], capacity_blocks=100)  # no resync yet: a stream that sends no events
    assert not indexes.is_synced("a") and indexes.match_length("a", CHAIN) == 0
    synced(indexes, "a", *CHAIN)
    assert indexes.is_synced("a") and indexes.match_length("a", CHAIN) == 4
    indexes.disconnected("a")
    assert not indexes.is_synced("a") and indexes.match_length("a", CHAIN) == 0


def test_a_routed_prompt_counts_as_held_until_a_report_after_it_ends() -> None:
    """Blocks are reported once computed: until then the gateway's own routing stands in for them, so a
    burst sharing a new prompt follows the first request. The prediction goes at the second report after
    the request ends (by then the replica's events say what it kept)."""
    indexes = BlockIndexes()
    synced(indexes, "a")
    first = indexes.predict("a", CHAIN)
    second = indexes.predict("a", CHAIN[:2])  # a second request sharing two blocks
    assert indexes.match_length("a", CHAIN) == 4
    first.retire(CHAIN)
    assert indexes.match_length("a", CHAIN) == 4  # ended, but no report since
    indexes.apply("a", [], capacity_blocks=100)  # a report that may have been built before the commit
    assert indexes.match_length("a", CHAIN) == 4
    indexes.apply("a", [KvStored(CHAIN[:1])], capacity_blocks=100)  # it kept one block
    assert indexes.match_length("a", CHAIN) == 2  # block 1 held, block 2 still predicted by the other
    second.retire(CHAIN[:2])
    indexes.apply("a", [], capacity_blocks=100)
    indexes.apply("a", [], capacity_blocks=100)
    assert indexes.match_length("a", CHAIN) == 1


def test_a_request_on_kv_blocks_counts_tokens_exactly_as_the_engine_serves_them() -> None:
    body = {"prompt": "x"}
    route = build_route_request(body, "m", None, 256, 1, token_ids=list(range(40)), block_size_tokens=16)
    assert route.hash_tokens == 16 and route.estimated_prompt_tokens == 40
    assert route.prefix_hashes == tuple(hash_blocks(list(range(40)), 16))  # 2 full blocks
    assert route.uncached_tokens(0) == 40 and route.uncached_tokens(2) == 8
    exact = build_route_request(body, "m", None, 256, 1, token_ids=list(range(32)), block_size_tokens=16)
    assert exact.uncached_tokens(2) == 16  # the last token is always computed: a whole block is served again
    assert route.covers(1, 0, 0.4) and not route.covers(1, 0, 0.5)  # 16 of 40 tokens
    adapter = build_route_request(body, "m", "sql", 256, 1, token_ids=list(range(40)), block_size_tokens=16)
    assert adapter.prefix_hashes == tuple(hash_blocks(list(range(40)), 16, "sql")) != route.prefix_hashes


@pytest.mark.parametrize("holder", ["a", "b"])
def test_cache_aware_goes_to_the_replica_whose_events_hold_the_prompt(holder: str) -> None:
    tokens = list(range(200))
    route = build_route_request({"prompt": "x"}, "m", None, 256, 1, token_ids=tokens, block_size_tokens=16)
    indexes = BlockIndexes()
    for rid in ("a", "b"):
        synced(indexes, rid, *(route.prefix_hashes if rid == holder else ()))
    states = [ReplicaState(rid, "", "m", True, False, 0, kv_blocks_free=100, kv_blocks_total=100) for rid in "ab"]
    decision = cache_aware(route, ReplicaView.of(states, indexes), RoutingKnobs())
    assert decision.replica_id == holder and decision.reason is Reason.PREFIX_HIT
    assert decision.predicted_match_chunks == 12  # 200 tokens: 12 full blocks


def test_a_prediction_on_a_replica_whose_stream_is_down_goes_when_its_request_ends() -> None:
    indexes = BlockIndexes()
    synced(indexes, "a")
    indexes.disconnected("a")
    indexes.predict("a", CHAIN).retire(CHAIN)  # no report will come while the stream is down: nothing may pile up
    synced(indexes, "a")
    assert indexes.match_length("a", CHAIN) == 0 and not indexes.get("a").predicted


def test_the_working_set_is_what_a_later_request_matched_while_the_replica_held_it() -> None:
    indexes = BlockIndexes()
    assert indexes.cache_fill("a") is None  # never heard of
    indexes.apply("a", [KvStored(CHAIN)], capacity_blocks=100)
    assert indexes.cache_fill("a") is None  # not synced: says nothing
    synced(indexes, "a", *CHAIN[:3])
    indexes.predict("a", CHAIN)  # the first request since the resync: nothing came back yet...
    assert indexes.cache_fill("a") == CacheFill(reused_chunks=3, capacity_chunks=100)  # ...but blocks it held
    other = tuple(hash_blocks(list(range(100, 164)), 16))
    indexes.predict("a", other)  # new text: held nowhere, so not reused
    indexes.predict("a", other)  # predicted only (not yet reported stored): not counted either
    assert indexes.cache_fill("a").reused_chunks == 3
    indexes.apply("a", [KvStored(other[:2])], capacity_blocks=100)
    indexes.predict("a", other[:2])
    assert indexes.cache_fill("a").reused_chunks == 5
    indexes.apply("a", [KvRemoved((CHAIN[2], other[1]))], capacity_blocks=100)  # evicted: no longer held
    assert indexes.cache_fill("a").reused_chunks == 3
    indexes.disconnected("a")
    assert indexes.cache_fill("a") is None
    synced(indexes, "a", *CHAIN)
    assert indexes.cache_fill("a").reused_chunks == 0  # a resync starts the working set afresh


def test_new_text_avoids_an_engine_whose_working_set_fills_its_cache() -> None:
    # Two idle engines of 16 blocks; 0.85 of them (13 blocks) may hold the working set. A 14-block
    # conversation came back to "a"; a new 4-block prompt would push 4 blocks of it out there.
    conversation = tuple(hash_blocks(list(range(1000, 1000 + 14 * 16)), 16))
    route = build_route_request({"prompt": "x"}, "m", None, 256, 1, token_ids=list(range(5000, 5064)),
                                block_size_tokens=16)
    states = [ReplicaState(rid, "", "m", True, False, 0, kv_blocks_free=16, kv_blocks_total=16) for rid in "ab"]
    indexes = BlockIndexes()
    synced(indexes, "a")
    synced(indexes, "b")
    for rid in "ab":
        indexes.apply(rid, [], capacity_blocks=16)
    first = cache_aware(route, ReplicaView.of(states, indexes), RoutingKnobs()).replica_id
    indexes.apply(first, [KvStored(conversation)], capacity_blocks=16)
    indexes.predict(first, conversation)
    assert indexes.cache_fill(first) == CacheFill(reused_chunks=14, capacity_chunks=16)
    assert cache_aware(route, ReplicaView.of(states, indexes), RoutingKnobs()).replica_id != first
