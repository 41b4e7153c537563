"""What the gateway makes of a replica's answer (`router.outcomes`): pure, so every case is a value in, a value out."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from kvgate.router.features import build_route_request
from kvgate.router.outcomes import (Answer, DecisionRecord, DecisionRing, StreamEnd, cached_tokens_of,
                                    caching_judgement_log, prompt_tokens_of, stream_end, text_chain,
                                    tokens_used_of)
from kvgate.router.policies import Reason, RouteDecision
from kvgate.router.prefix_index import CachingJudgement
from kvgate.router.upstream import UpstreamError

CHUNK = 64
PROMPT = "x" * 700  # 700 canonical chars: 10 full chunks of 64 and a partial one


def route(prompt: str = PROMPT, **changes: object):  # noqa: ANN201 - RouteRequest
    return replace(build_route_request({"prompt": prompt}, "m", None, CHUNK, 0), **changes)


def usage(prompt_tokens: object = 100, cached_tokens: object = 40) -> dict[str, object]:
    return {"usage": {"prompt_tokens": prompt_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}}


@pytest.mark.parametrize("payload,cached,prompt", [
    (usage(100, 40), 40, 100),
    (usage(0, 0), 0, 0),
    ({"usage": {"prompt_tokens": 100}}, None, 100),  # vLLM without --enable-prompt-tokens-details
    ({"usage": {"prompt_tokens": 100, "prompt_tokens_details": None}}, None, 100),
    ({"choices": []}, None, None),  # no usage at all
    (usage(-1, -5), None, None),  # a count never goes back
    (usage(True, False), None, None),  # JSON true is not a count
    (usage(1.5, "40"), None, None),
    (usage((1 << 31) + 1, 1 << 40), None, None),  # longer than any prompt
    (None, None, None),  # the body was not JSON
    ([usage()], None, None),  # JSON, but not an object
])
def test_usage_counts_are_read_only_where_they_are_counts(payload: object, cached: int | None,
                                                          prompt: int | None) -> None:
    assert (cached_tokens_of(payload), prompt_tokens_of(payload)) == (cached, prompt)


def test_the_text_index_records_the_text_chain_also_for_a_request_routed_on_kv_blocks() -> None:
    text = route()
    assert text_chain(text) == text.prefix_hashes
    on_blocks = replace(text, prefix_hashes=(7, 8, 9), hash_tokens=16, text_hashes=text.prefix_hashes)
    assert text_chain(on_blocks) == text.prefix_hashes


@pytest.mark.parametrize("prompt_tokens,teaches", [
    (None, False),  # the replica did not say
    (175, True),
    (4 * 700 + 4096, True),  # every char a 4-byte token, plus a chat template's own
    (4 * 700 + 4097, False),  # more than the text can hold: an image part's, say
])
def test_a_reported_prompt_size_teaches_only_when_the_text_can_hold_it(prompt_tokens: int | None,
                                                                       teaches: bool) -> None:
    assert Answer(route(), 0, None, prompt_tokens).teaches_prompt_size is teaches


def test_tokens_disagree_only_for_a_request_on_kv_blocks_counted_otherwise_by_the_replica() -> None:
    on_blocks = route(hash_tokens=16, estimated_prompt_tokens=200)
    assert Answer(on_blocks, 0, None, 201).tokens_disagree
    assert not Answer(on_blocks, 0, None, 200).tokens_disagree
    assert not Answer(on_blocks, 0, None, None).tokens_disagree  # no count: nothing to compare
    assert not Answer(route(estimated_prompt_tokens=200), 0, None, 201).tokens_disagree  # text: an estimate


def test_predicted_tokens_on_text_are_the_predicted_chunks_characters_over_chars_per_token() -> None:
    # 3 chunks of 64 chars = 192 chars, at 4 chars per token -> 48 tokens
    assert Answer(route(), 3, 30, 175).lesson(4.0).predicted_tokens == 48
    # never more chunks than the chain: 99 predicted of 10 -> 10 x 64 = 640 chars at 3.5 -> 182 tokens
    lesson = Answer(route(), 99, 30, 175).lesson(3.5)
    assert (lesson.predicted_chunks, lesson.predicted_tokens) == (10, 182)
    # never more chars than the prompt: 10 chunks of 100 chars, of a 700-char prompt at 3.5 -> 200 tokens
    assert Answer(route(chunk_chars=100), 10, 30, 175).lesson(3.5).predicted_tokens == 200


def test_predicted_tokens_on_kv_blocks_are_exact() -> None:
    # 10 blocks of 16 of a 200-token prompt predicted held: 160 tokens cached, 40 to prefill
    on_blocks = route(prefix_hashes=tuple(range(12)), hash_tokens=16, estimated_prompt_tokens=200)
    assert Answer(on_blocks, 10, 160, 200).lesson(4.0).predicted_tokens == 160


def test_no_more_of_a_prompt_is_cached_than_the_prompt() -> None:
    assert Answer(route(), 0, 500, 175).lesson(4.0).cached_tokens == 175  # the replica's count
    estimated = route().estimated_prompt_tokens
    assert Answer(route(), 0, 10_000, None).lesson(4.0).cached_tokens == estimated  # else the gateway's
    assert Answer(route(), 0, 30, 175).lesson(4.0).cached_tokens == 30


def test_the_prompt_tokens_realised_counts_are_out_of_are_the_replicas_else_the_gateways() -> None:
    assert Answer(route(), 0, 30, 175).lesson(4.0).prompt_tokens == 175
    assert Answer(route(), 0, 30, None).lesson(4.0).prompt_tokens == route().estimated_prompt_tokens


def test_an_answer_that_does_not_say_what_was_cached_realises_nothing() -> None:
    assert Answer(route(), 3, None, 175).lesson(4.0).cached_tokens is None


def test_a_replica_that_stops_caching_is_a_warning_naming_it_and_the_evidence() -> None:
    level, line = caching_judgement_log("r1", CachingJudgement(caches=False, num_recent_predicted_hits=16))
    assert level == logging.WARNING and "r1" in line and "last 16 predicted" in line


def test_a_replica_that_caches_again_is_an_info_line() -> None:
    level, line = caching_judgement_log("r1", CachingJudgement(caches=True, num_recent_predicted_hits=16))
    assert level == logging.INFO and "r1" in line and "again" in line


@pytest.mark.parametrize("done,error,expected", [
    (True, None, StreamEnd("success")),
    (False, None, StreamEnd("broken_stream", "stream_broken", "the replica's stream ended before [DONE]")),
    (False, TimeoutError(), StreamEnd("stream_idle_timeout", "stream_idle_timeout",
                                      "the replica sent nothing for 2.5 s")),
    (False, UpstreamError("reset"), StreamEnd("broken_stream", "stream_broken",
                                              "the replica's stream broke: reset")),
])
def test_a_stream_ends_well_only_at_done(done: bool, error: Exception | None, expected: StreamEnd) -> None:
    assert stream_end(done, error, idle_timeout_s=2.5) == expected


def test_a_stream_given_up_on_a_replica_that_stopped_answering_health_checks_says_so() -> None:
    end = stream_end(False, UpstreamError("given up"), idle_timeout_s=2.5, unresponsive=True)
    assert (end.outcome, end.error_code) == ("replica_unhealthy", "replica_unhealthy")
    assert "stopped answering its health checks" in end.message


def decision(replica_id: str = "r1") -> RouteDecision:
    return RouteDecision(replica_id=replica_id, reason=Reason.PREFIX_HIT, predicted_match_chunks=3, load=2,
                         load_cap=5, num_candidates=4)


def test_a_decision_record_serves_the_keys_the_dashboard_reads() -> None:
    record = DecisionRecord.of(decision(), route(adapter="fr"), request_id="req-1", attempt=1,
                               excluded={"r9", "r0"}, wall=1700000000.5)
    assert json.loads(json.dumps(record.as_json())) == {
        "wall": 1700000000.5, "model": "m", "adapter": "fr", "request_id": "req-1", "replica": "r1",
        "reason": "prefix_hit", "attempt": 1, "predicted_match_chunks": 3, "load": 2, "load_cap": 5,
        "num_candidates": 4, "excluded": ["r0", "r9"]}


def test_the_decision_ring_keeps_the_newest_records_oldest_first() -> None:
    ring = DecisionRing(size=3)
    for i in range(5):
        ring.append(DecisionRecord.of(decision(f"r{i}"), route(), request_id="", attempt=0, excluded=set(),
                                      wall=float(i)))
    assert [record.replica for record in ring] == ["r2", "r3", "r4"]
    assert [entry["replica"] for entry in ring.as_json()] == ["r2", "r3", "r4"]


@pytest.mark.parametrize("payload, used", [
    ({"usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}, 15),
    ({"usage": {"prompt_tokens": 10, "completion_tokens": 0}}, 10),
    ({"usage": {"prompt_tokens": 10}}, None),  # half a usage settles nothing
    ({"usage": {"prompt_tokens": 10, "completion_tokens": -5}}, None),  # not a count
    ({"usage": {"prompt_tokens": True, "completion_tokens": 5}}, None),
    ({"usage": None}, None), ({}, None), (None, None), ([1], None),
])
def test_tokens_used_is_prompt_plus_completion_when_both_are_counts(payload: object, used: int | None) -> None:
    assert tokens_used_of(payload) == used
