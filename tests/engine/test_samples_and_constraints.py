"""n > 1 samples forked from one prefill, logit_bias and constrained decoding, in the engine core on tiny-llama.

The equivalence checks are what make a fork correct: sample i of an n = 4 request must produce exactly what
a lone request seeded seed + i produces (its KV, the shared blocks and its copy of the partial one, must be
the prompt's), while the block counters show the prompt's full blocks held once.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from kvgate.engine.core import EngineConfig, EngineCore
from kvgate.engine.sequence import Constraint, FinishReason, SamplingParams
from kvgate.engine.structured import GrammarError
from tests.engine.builtin_cache import shared_cache_dir, tiny_llama_dir

PROMPT = list(range(40, 80))  # 40 tokens: two full blocks of 16 and a partial third
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)


def make_core(**overrides) -> EngineCore:
    tiny_llama_dir()
    return EngineCore(EngineConfig(model="builtin:tiny-llama", cache_dir=shared_cache_dir(),
                                   **{"kv_cache_bytes": 4 << 20, **overrides}))


def run(core: EngineCore, seq_ids: list[int]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {s: [] for s in seq_ids}
    while core.has_unfinished():
        for delta in core.step():
            tokens[delta.seq_id].append(delta.token_id)
    return tokens


@pytest.mark.parametrize("caching", [True, False])
def test_samples_share_the_prompts_blocks_and_draw_as_lone_seeded_requests(caching: bool) -> None:
    core = make_core(enable_prefix_caching=caching)
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=4))
    assert len(ids) == 4
    free_before = core.block_manager.num_free_blocks
    first = core.step()  # the prefill: every sample's first token, the forks made
    assert sorted(d.index for d in first) == [0, 1, 2, 3]
    parent = core.scheduler.get(ids[0])
    shared = parent.block_table[:2]
    assert [core.block_manager.ref_count(b) for b in shared] == [4, 4]
    lasts = {core.scheduler.get(s).block_table[2] for s in ids}
    assert len(lasts) == 4  # each sample writes its own copy of the partial block
    assert free_before - core.block_manager.num_free_blocks == 2 + 4  # 12 without sharing
    together = run(core, ids)
    for d in first:
        together[d.seq_id].insert(0, d.token_id)

    for index, seq_id in enumerate(ids):
        alone = make_core(enable_prefix_caching=caching)
        lone_id = alone.add_request(PROMPT, dataclasses.replace(SAMPLED, seed=SAMPLED.seed + index))
        assert run(alone, [lone_id])[lone_id] == together[seq_id], f"sample {index}"
    assert len({tuple(t) for t in together.values()}) > 1  # different seeds, different samples


def test_a_prompt_of_whole_blocks_is_shared_without_a_copy() -> None:
    core = make_core()
    ids = core.add_requests(PROMPT[:32], dataclasses.replace(SAMPLED, n=3))
    core.step()
    tables = [core.scheduler.get(s).block_table for s in ids]
    assert tables[0] == tables[1] == tables[2]  # the next token opens a new block for each
    assert [core.block_manager.ref_count(b) for b in tables[0]] == [3, 3]


def test_samples_ending_early_or_aborted_free_what_they_hold() -> None:
    core = make_core()
    total = core.block_manager.num_free_blocks
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=4, max_tokens=1))
    assert all(d.finish_reason is FinishReason.LENGTH for d in core.step())
    assert not core.has_unfinished()
    assert core.block_manager.num_free_blocks == total
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=3))
    core.step()
    for s in ids:
        core.abort(s)
    assert not core.has_unfinished() and core.block_manager.num_free_blocks == total


def test_samples_never_push_a_batch_past_max_num_seqs() -> None:
    core = make_core(max_num_seqs=4)
    ids = [*core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=3)),
           *core.add_requests(PROMPT[:20], dataclasses.replace(SAMPLED, n=3)),
           core.add_request(PROMPT[:30], SAMPLED)]
    most = 0
    tokens = {s: 0 for s in ids}
    while core.has_unfinished():
        for delta in core.step():
            tokens[delta.seq_id] += 1
        most = max(most, core.scheduler.num_running)
    assert most <= 4 and all(count == 12 for count in tokens.values())
    with pytest.raises(ValueError, match="at most 4 sequences"):
        core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=5))


def test_a_fork_that_finds_no_block_starts_over_with_its_own_seed() -> None:
    # A pool of 4 blocks of 16 (tiny-llama: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB each):
    # the 40-token prompt takes 3, so only the first fork finds a block for its copy.
    core = make_core(kv_cache_bytes=4 * 8192, max_model_len=60)
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=3, max_tokens=4))
    first = core.step()
    assert core.scheduler.get(ids[2]).status.value == "waiting"  # it computes the prompt itself, later
    together = run(core, ids)
    for delta in first:
        together[delta.seq_id].insert(0, delta.token_id)
    for index, seq_id in enumerate(ids):
        alone = make_core()
        lone_id = alone.add_request(PROMPT, dataclasses.replace(SAMPLED, max_tokens=4, seed=SAMPLED.seed + index))
        assert run(alone, [lone_id])[lone_id] == together[seq_id], f"sample {index}"


def test_forks_of_a_sequence_aborted_before_its_prefill_compute_the_prompt_themselves() -> None:
    core = make_core()
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=3))
    core.abort(ids[0])
    tokens = run(core, ids[1:])
    assert [len(tokens[s]) for s in ids[1:]] == [12, 12]


def test_logit_bias_steers_greedy_choice() -> None:
    core = make_core()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = run(core, [core.add_request(PROMPT, greedy)])
    favoured = 77
    biased_id = core.add_request(PROMPT, dataclasses.replace(greedy, logit_bias=((favoured, 100.0),)))
    assert run(core, [biased_id])[biased_id] == [favoured] * 6
    banned = next(iter(plain.values()))[0]
    banned_id = core.add_request(PROMPT, dataclasses.replace(greedy, logit_bias=((banned, -100.0),)))
    assert banned not in run(core, [banned_id])[banned_id]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}


def test_constrained_rows_match_their_schema_and_unconstrained_rows_are_untouched() -> None:
    core = make_core()
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    alone = make_core()
    free_alone_id = alone.add_request(PROMPT, free)
    expected_free = run(alone, [free_alone_id])[free_alone_id]
    ids = core.add_requests(PROMPT, dataclasses.replace(free, max_tokens=200, seed=11, n=6, constraint=constraint))
    free_id = core.add_request(PROMPT, free)
    texts: dict[int, str] = {s: "" for s in ids}
    reasons = {}
    while core.has_unfinished():
        for delta in core.step():
            if delta.seq_id in texts:
                texts[delta.seq_id] += delta.text
                reasons[delta.seq_id] = delta.finish_reason or reasons.get(delta.seq_id)
    for s in ids:
        jsonschema.validate(json.loads(texts[s]), SCHEMA)
        assert reasons[s] is FinishReason.STOP  # the grammar's end stops it
    assert core.grammars.num_matchers == 0
    rerun = make_core()
    rerun_id = rerun.add_request(PROMPT, free)
    assert run(rerun, [rerun_id])[rerun_id] == expected_free  # unconstrained: as alone


def test_a_schema_the_library_cannot_enforce_is_refused_naming_the_part() -> None:
    core = make_core()
    bad = Constraint("json_schema", json.dumps({"type": "string", "format": "no-such-format"}))
    with pytest.raises(GrammarError, match="no-such-format"):
        core.add_request(PROMPT, dataclasses.replace(SAMPLED, constraint=bad))
    assert not core.has_unfinished() and core.grammars.num_matchers == 0


def test_sequences_copy_a_compiled_prototype_and_the_book_is_bounded_by_bytes(monkeypatch) -> None:
    import llguidance

    from kvgate.engine.structured import GrammarBook

    book = GrammarBook(make_core().tokenizer.to_json, (1,), 290, max_grammar_bytes=3_000)
    built = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", type("Counting", (), {
        "__new__": lambda cls, *a, **k: built.append(1) or real(*a, **k),
        "grammar_from_json_schema": staticmethod(real.grammar_from_json_schema),
        "grammar_from_lark": staticmethod(real.grammar_from_lark)}))
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    book.compile(schema)  # on the server's thread
    for seq_id in range(16):  # on the engine's: copies only
        book.start(seq_id, schema)
    assert len(built) == 1 and book.num_matchers == 16
    for i in range(6):  # each grammar is ~1 KB of text: the book keeps the last few only
        book.compile(Constraint("json_schema", json.dumps({**SCHEMA, "title": f"v{i}"})))
    book.compile(schema)
    assert len(built) == 8  # the first was evicted and compiled again


def test_pending_forks_count_as_waiting_and_survive_their_first_sample_being_preempted() -> None:
    # 8 blocks: a 100-token prompt (7 blocks) admitted first; the n = 2 request's prompt (3 blocks) must wait,
    # and once running, its first sample is preempted by the older sequence's growth before it samples.
    core = make_core(kv_cache_bytes=8 * 8192, max_model_len=120, max_num_batched_tokens=16)
    old = core.add_request(list(range(3, 103)), dataclasses.replace(SAMPLED, max_tokens=12))
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=2, max_tokens=6))
    assert core.scheduler.num_waiting == 3  # the older request, the first sample, and its fork
    tokens = run(core, [old, *ids])
    assert [len(tokens[s]) for s in (old, *ids)] == [12, 6, 6]
    assert core.scheduler.num_preemptions_total >= 1 and core.block_manager.num_free_blocks == 8
    for index, seq_id in enumerate(ids):  # a preempted or requeued sample still draws as a lone one
        alone = make_core()
        lone_id = alone.add_request(PROMPT, dataclasses.replace(SAMPLED, max_tokens=6, seed=SAMPLED.seed + index))
        assert run(alone, [lone_id])[lone_id] == tokens[seq_id], f"sample {index}"


def test_a_schema_compiled_by_two_threads_at_once_is_kept_and_counted_once() -> None:
    import threading

    from kvgate.engine.structured import GrammarBook

    book = GrammarBook(make_core().tokenizer.to_json, (1,), 290)
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    threads = [threading.Thread(target=book.compile, args=(schema,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(book._prototypes) == 1
    assert book._prototype_bytes == next(iter(book._prototypes.values()))[1]


def test_request_counters_count_requests_not_samples() -> None:
    core = make_core()
    run(core, core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=4)))
    ids = core.add_requests(PROMPT, dataclasses.replace(SAMPLED, n=3))
    core.step()
    core.abort(ids[0])
    assert core.stats().num_requests_aborted_total == 0  # two of its samples still run
    for seq_id in ids[1:]:
        core.abort(seq_id)
    stats = core.stats()
    assert (stats.num_requests_finished_total, stats.num_requests_aborted_total) == (1, 1)
    assert not core._request_of and not core._open_samples
