"""The scheduler: chunked prefill under a token budget, decodes first, seats, prefix-cache admission,
preemption by recompute, stops, aborts, and a randomized run checked against a reference.

The fake runner keeps a paged KV cache of its own: the "KV" of position p is a digest of tokens
0..p, written through the block table, and the next token is read off the digest at the last
position, so a sequence's tokens depend on every block it reads. Any paging bug (a block reused while
in use, a cached block with other content, a skipped chunk) changes the tokens or raises, and
`reference_tokens` computes what a correct engine must produce with no engine at all.
Block size 4 everywhere, so pools are tiny and the numbers small.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from kvgate.engine.sequence import (FinishReason, ModelInput, ModelOutput, SampledToken, SamplingParams, Sequence,
                             SequenceStatus)

BS = 4
RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED


def mix(digest: int, token: int) -> int:
    return (digest * 1_000_003 + token + 1) % (2**61 - 1)


def reference_tokens(prompt, count: int) -> list[int]:
    """The tokens a correct engine generates for `prompt` with the fake runner."""
    digest, out = 0, []
    for token in prompt:
        digest = mix(digest, token)
    for _ in range(count):
        out.append(digest % 1000)
        digest = mix(digest, out[-1])
    return out


class FakeRunner:
    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: dict[tuple[int, int], int] = {}  # (block, slot) -> digest of tokens 0..position

    def execute(self, batch: ModelInput) -> ModelOutput:
        sampled = []
        for work in batch.seqs:
            table = work.block_table
            assert len(table) * BS >= work.start_pos + len(work.token_ids), "table must cover the chunk"
            pos = work.start_pos - 1
            digest = self.kv[table[pos // BS], pos % BS] if pos >= 0 else 0
            for pos, token in enumerate(work.token_ids, start=work.start_pos):
                assert self.bm.ref_count(table[pos // BS]) == 1, "never write into a shared block"
                digest = mix(digest, token)
                self.kv[table[pos // BS], pos % BS] = digest
            if work.sample:
                sampled.append(SampledToken(work.seq_id, digest % 1000))
        return ModelOutput(tuple(sampled))


def make(num_blocks: int = 64, prefix_caching: bool = True,
         **config) -> tuple[Scheduler, BlockManager, FakeRunner]:
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=prefix_caching)
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=min(64, num_blocks * BS))
    return Scheduler(SchedulerConfig(**{**defaults, **config}), bm), bm, FakeRunner(bm)


def seq_of(seq_id: int, prompt, max_tokens: int = 4, **params) -> Sequence:
    return Sequence(seq_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, **params))


def step(sched: Scheduler, runner: FakeRunner) -> tuple[ModelInput, list[StepResult]]:
    batch = sched.schedule()
    return batch, sched.update(batch, runner.execute(batch))


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list[ModelInput]:
    batches = []
    while sched.has_unfinished():
        batches.append(step(sched, runner)[0])
        assert len(batches) < max_steps
    return batches


def chunks(batch: ModelInput) -> list[tuple[int, int, int, bool]]:
    """(seq_id, start_pos, number of tokens, sample) of each scheduled sequence."""
    return [(w.seq_id, w.start_pos, len(w.token_ids), w.sample) for w in batch.seqs]


# ----- admission and chunked prefill


def test_budget_8_prefills_a_20_token_prompt_in_chunks_8_8_4_and_samples_only_on_the_last() -> None:
    sched, bm, runner = make(max_num_batched_tokens=8)
    seq = seq_of(1, range(20), max_tokens=2)
    sched.add(seq)
    batches = run_to_end(sched, runner)
    assert [chunks(b) for b in batches] == [
        [(1, 0, 8, False)], [(1, 8, 8, False)], [(1, 16, 4, True)],  # prefill: 20 = 8 + 8 + 4
        [(1, 20, 1, True)],  # one decode; the second token reaches max_tokens
    ]
    assert [len(b.seqs[0].block_table) for b in batches] == [2, 4, 5, 6]  # ceil((start + n) / 4)
    assert batches[1].seqs[0].token_ids == tuple(range(8, 16))
    assert seq.output_token_ids == reference_tokens(range(20), 2)
    assert seq.finish_reason is FinishReason.LENGTH
    assert bm.num_free_blocks == bm.num_total_blocks


def test_running_sequences_decode_first_then_prefills_then_new_arrivals() -> None:
    sched, _, runner = make(max_num_batched_tokens=8, long_prefill_chunk=4)
    sched.add(seq_of(1, range(20)))  # long prompt, 4 tokens a step
    sched.add(seq_of(2, range(100, 104)))  # short prompt, done in one chunk
    assert chunks(step(sched, runner)[0]) == [(1, 0, 4, False), (2, 0, 4, True)]
    sched.add(seq_of(3, range(200, 210)))
    # Seq 2 decodes before the older seq 1's next chunk; seq 3 gets the 8 - 1 - 4 = 3 tokens left.
    assert chunks(step(sched, runner)[0]) == [(2, 4, 1, True), (1, 4, 4, False), (3, 0, 3, False)]


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    sched, _, runner = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq_of(i, range(10 * i, 10 * i + 5), max_tokens=2))
    assert [w.seq_id for w in step(sched, runner)[0].seqs] == [0, 1]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    step(sched, runner)  # 0 and 1 reach max_tokens; their seats free up
    assert [w.seq_id for w in step(sched, runner)[0].seqs] == [2]


def test_waiting_sequences_are_admitted_in_fifo_order_without_skipping() -> None:
    sched, _, runner = make(num_blocks=6, max_model_len=24)
    sched.add(seq_of(1, range(16), max_tokens=8))  # 4 blocks + growth
    sched.add(seq_of(2, range(100, 112)))  # needs 3 blocks; only 2 are free
    sched.add(seq_of(3, range(200, 202)))  # would fit, but must not overtake seq 2
    assert [w.seq_id for w in step(sched, runner)[0].seqs] == [1]
    assert sched.num_waiting == 2


def test_a_shared_prompt_prefix_is_served_from_the_cache_on_admission() -> None:
    sched, bm, runner = make()
    first, second = seq_of(1, range(10), max_tokens=1), seq_of(2, [*range(10), 77, 78])
    sched.add(first)
    run_to_end(sched, runner)
    sched.add(second)
    batch, _ = step(sched, runner)
    # first cached blocks 0..3 and 4..7 (tokens 8, 9 are a partial block): 8 of 12 tokens hit.
    assert chunks(batch) == [(2, 8, 4, True)]
    assert second.num_cached_tokens == 8
    assert (bm.queried_tokens_total, bm.hit_tokens_total) == (10 + 12, 8)
    run_to_end(sched, runner)
    assert second.output_token_ids == reference_tokens([*range(10), 77, 78], 4)


def test_a_prompt_whose_prefix_is_being_computed_waits_a_step_and_hits_it() -> None:
    sched, bm, runner = make()
    system = list(range(12))  # 3 full blocks
    first, second = seq_of(1, [*system, 50, 51]), seq_of(2, [*system, 60, 61])
    other = seq_of(3, range(200, 206))
    for seq in (first, second, other):
        sched.add(seq)
    # second's first block is first's to compute: it waits, keeping its place; other is admitted behind it.
    assert chunks(step(sched, runner)[0]) == [(1, 0, 14, True), (3, 0, 6, True)]
    assert sched.num_waiting == 1 and bm.num_claimed_blocks == 0  # first committed all its claims
    assert chunks(step(sched, runner)[0]) == [(1, 14, 1, True), (3, 6, 1, True), (2, 12, 2, True)]
    assert second.num_cached_tokens == 12 and bm.hit_tokens_total == 12
    run_to_end(sched, runner)
    assert second.output_token_ids == reference_tokens(second.prompt_token_ids, 4)


def test_a_waiting_prompt_follows_a_chunked_prefill_of_its_prefix_block_by_block() -> None:
    sched, bm, runner = make(long_prefill_chunk=4)
    first, second = seq_of(1, [*range(12), 50]), seq_of(2, [*range(12), 60])
    sched.add(first)
    sched.add(second)
    assert chunks(step(sched, runner)[0]) == [(1, 0, 4, False)]
    assert bm.num_claimed_blocks == 2  # blocks 1 and 2 of the shared prompt are still to come
    assert chunks(step(sched, runner)[0]) == [(1, 4, 4, False)]
    assert chunks(step(sched, runner)[0]) == [(1, 8, 4, False)]
    assert chunks(step(sched, runner)[0]) == [(1, 12, 1, True), (2, 12, 1, True)]
    assert second.num_cached_tokens == 12


def test_a_prompt_waiting_on_a_prefix_computes_it_itself_once_the_other_is_aborted() -> None:
    sched, bm, runner = make(long_prefill_chunk=4)
    first, second = seq_of(1, [*range(12), 50]), seq_of(2, [*range(12), 60])
    sched.add(first)
    sched.add(second)
    step(sched, runner)
    sched.abort(1)
    assert bm.num_claimed_blocks == 0
    assert chunks(step(sched, runner)[0]) == [(2, 4, 4, False)]  # block 0 is cached; the rest is its own
    run_to_end(sched, runner)
    assert second.output_token_ids == reference_tokens(second.prompt_token_ids, 4)


def test_a_prompt_waiting_on_a_prefix_does_not_hold_back_later_adapters() -> None:
    class EverySlotFree:
        def on_add(self, adapter: str) -> None: pass
        def can_run(self, adapter: str) -> bool: return True
        def on_run(self, adapter: str) -> None: pass
        def on_stop(self, adapter: str) -> None: pass
        def on_finish(self, adapter: str) -> None: pass

    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm,
                      EverySlotFree())
    sched.add(seq_of(1, [*range(8), 1]))
    sched.add(seq_of(2, [*range(8), 2]))
    sched.add(Sequence(3, tuple(range(300, 305)), SamplingParams(max_tokens=2), adapter="sql"))
    assert [w.seq_id for w in sched.schedule().seqs] == [1, 3]


# ----- preemption


def test_the_newest_running_sequence_is_preempted_when_blocks_run_out() -> None:
    # 4 blocks of 4 = 16 tokens. A (8 tokens) and B (6) fill all 4 blocks; each samples one token.
    # Next step A decodes position 8, which opens a 5th block: B, the newest, is preempted.
    sched, bm, runner = make(num_blocks=4, max_model_len=16, prefix_caching=False)
    a, b = seq_of(1, range(8), max_tokens=3), seq_of(2, range(100, 106), max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched, runner)
    assert bm.num_free_blocks == 0
    batch, _ = step(sched, runner)
    assert chunks(batch) == [(1, 8, 1, True)]  # nothing admitted in a step that preempted
    assert (b.status, b.num_computed_tokens, b.block_table, b.num_preemptions) == (WAITING, 0, [], 1)
    assert 2 not in batch.released_seq_ids  # the runner keeps a preempted sequence's state
    step(sched, runner)  # A finishes (3 tokens); B is not admitted yet as A still holds its blocks
    batch, _ = step(sched, runner)
    # B resumes: its 7 known tokens (6 prompt + 1 generated) are recomputed in one chunk.
    assert chunks(batch) == [(2, 0, 7, True)]
    assert batch.seqs[0].token_ids == (*range(100, 106), b.output_token_ids[0])
    run_to_end(sched, runner)
    assert a.output_token_ids == reference_tokens(range(8), 3)
    assert b.output_token_ids == reference_tokens(range(100, 106), 3)
    assert b.num_cached_tokens == 0 and bm.queried_tokens_total == 14  # the resume is not a query


def test_the_newest_sequence_preempts_itself_when_it_is_the_one_that_needs_a_block() -> None:
    # A (6 tokens) has room in its 2nd block for position 6; B (8 tokens) needs a 5th block for position 8.
    sched, _, runner = make(num_blocks=4, max_model_len=16)
    a, b = seq_of(1, range(6), max_tokens=3), seq_of(2, range(100, 108), max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched, runner)
    batch, _ = step(sched, runner)
    assert chunks(batch) == [(1, 6, 1, True)]
    assert b.status is WAITING and b.num_preemptions == 1
    run_to_end(sched, runner)
    assert b.output_token_ids == reference_tokens(range(100, 108), 3)


def test_a_newest_sequence_already_scheduled_this_step_is_taken_out_of_the_batch() -> None:
    # 4 blocks of 4. A (12-token prompt, 4-token chunks) is older than B (3 tokens), which decodes.
    sched, _, runner = make(num_blocks=4, max_model_len=16, max_num_batched_tokens=8, long_prefill_chunk=4)
    a, b = seq_of(1, range(12)), seq_of(2, range(100, 103))
    sched.add(a)
    sched.add(b)
    assert chunks(step(sched, runner)[0]) == [(1, 0, 4, False), (2, 0, 3, True)]  # 1 block each
    assert chunks(step(sched, runner)[0]) == [(2, 3, 1, True), (1, 4, 4, False)]  # A takes block 3 of 4
    # B decodes first and takes the last free block; then A's chunk 8..11 needs one more: B is
    # the newest, so it is preempted and its work in this step is withdrawn.
    assert chunks(step(sched, runner)[0]) == [(1, 8, 4, True)]
    assert b.status is WAITING and b.num_preemptions == 1
    run_to_end(sched, runner)
    assert b.output_token_ids == reference_tokens(range(100, 103), 4)


def test_a_resumed_sequence_reuses_its_own_cached_blocks() -> None:
    sched, bm, runner = make(num_blocks=5, max_model_len=20)
    a, b = seq_of(1, range(8), max_tokens=2), seq_of(2, range(100, 109), max_tokens=4)
    sched.add(a)
    sched.add(b)  # a: 2 blocks, b: 3 blocks (9 tokens); the pool is full
    step(sched, runner)
    step(sched, runner)  # a decodes position 8 -> needs a block -> b (newest) is preempted
    # b's blocks were freed tail first: the partial one (positions 8, 9) went to a, the two full
    # ones kept their hashes; a then finished (2 tokens) and freed its blocks.
    assert b.num_preemptions == 1 and a.is_finished
    batch, _ = step(sched, runner)
    # b: 10 known tokens; blocks 0..3 and 4..7 are still cached -> 8 cached, 2 recomputed.
    assert chunks(batch) == [(2, 8, 2, True)]
    run_to_end(sched, runner)
    assert b.output_token_ids == reference_tokens(range(100, 109), 4)


# ----- stops


STOP_PROMPT = tuple(range(6))
EOS = reference_tokens(STOP_PROMPT, 3)[2]  # the third generated token plays EOS


@pytest.mark.parametrize("params,config,count,reason", [
    (dict(max_tokens=5), {}, 5, FinishReason.LENGTH),
    (dict(max_tokens=9), dict(eos_token_ids=(EOS,)), 3, FinishReason.STOP),
    (dict(max_tokens=9, ignore_eos=True), dict(eos_token_ids=(EOS,)), 9, FinishReason.LENGTH),
    (dict(max_tokens=9, stop_token_ids=(EOS,)), {}, 3, FinishReason.STOP),
    (dict(max_tokens=3), dict(eos_token_ids=(EOS,)), 3, FinishReason.STOP),  # a stop beats the length
    (dict(max_tokens=50), dict(max_model_len=12), 12 - 6, FinishReason.LENGTH),  # 6 prompt + 6 out
])
def test_token_level_stops(params, config, count, reason) -> None:
    expected = reference_tokens(STOP_PROMPT, 9)
    assert EOS not in expected[:2] and EOS not in expected[3:]
    sched, bm, runner = make(**config)
    seq = seq_of(1, STOP_PROMPT, **params)
    sched.add(seq)
    results = [r for _ in range(20) if sched.has_unfinished() for r in step(sched, runner)[1]]
    assert seq.output_token_ids == expected[:count]  # a stop token stays in the output
    assert [r.finish_reason for r in results] == [None] * (count - 1) + [reason]
    assert results[-1].seq is seq and seq.finish_reason is reason and seq.status is FINISHED
    assert bm.num_free_blocks == bm.num_total_blocks
    assert sched.schedule().released_seq_ids == (1,)  # reported once, in the next step
    assert sched.schedule().released_seq_ids == ()


def test_an_external_finish_frees_the_sequence() -> None:
    sched, bm, runner = make()
    seq = seq_of(1, range(6), max_tokens=10)
    sched.add(seq)
    step(sched, runner)
    assert sched.finish(1, FinishReason.STOP)  # the detokenizer found a stop string
    assert (seq.finish_reason, sched.get(1), bm.num_free_blocks) == (FinishReason.STOP, None, 64)
    assert not sched.finish(1, FinishReason.STOP)


# ----- abort


def test_abort_frees_every_block_of_running_and_waiting_sequences() -> None:
    sched, bm, runner = make(num_blocks=8, max_model_len=32, max_num_seqs=2)
    for i in range(3):
        sched.add(seq_of(i, range(10 * i, 10 * i + 9), max_tokens=8))
    step(sched, runner)
    assert bm.num_free_blocks < bm.num_total_blocks
    assert [sched.abort(i) for i in (0, 1, 2, 7)] == [True, True, True, False]
    assert bm.num_free_blocks == bm.num_total_blocks
    assert not sched.has_unfinished() and (sched.num_running, sched.num_waiting) == (0, 0)
    assert sched.schedule().released_seq_ids == (0, 1, 2)


def test_aborting_between_schedule_and_update_is_safe() -> None:
    sched, bm, runner = make()
    a, b = seq_of(1, range(6)), seq_of(2, range(10, 16))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    output = runner.execute(batch)
    sched.abort(1)
    results = sched.update(batch, output)
    assert [r.seq.seq_id for r in results] == [2]
    assert a.output_token_ids == [] and a.finish_reason is FinishReason.ABORT
    assert bm.ref_count(batch.seqs[0].block_table[0]) == 0


def test_update_rejects_output_that_does_not_match_the_batch() -> None:
    sched, _, runner = make()
    sched.add(seq_of(1, range(6)))
    batch = sched.schedule()
    with pytest.raises(ValueError, match=r"sampled for sequences \[\]; the batch asked for \[1\]"):
        sched.update(batch, ModelOutput(()))


# ----- validation


def test_add_rejects_bad_prompts_and_duplicate_ids() -> None:
    sched, _, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add(seq_of(1, []))
    with pytest.raises(ValueError, match="the prompt has 16 tokens; this model's maximum length is 16"):
        sched.add(seq_of(1, range(16)))
    sched.add(seq_of(1, range(15)))
    with pytest.raises(ValueError, match="seq_id 1 is already in use"):
        sched.add(seq_of(1, range(3)))


def test_config_and_pool_are_checked() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=0, max_model_len=16)
    with pytest.raises(ValueError, match="the KV pool holds 16 tokens"):
        Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=17),
                  BlockManager(num_blocks=4, block_size=BS))


# ----- randomized run


def check_invariants(sched: Scheduler, bm: BlockManager, seqs: list[Sequence]) -> None:
    running = [s for s in seqs if s.status is RUNNING]
    waiting = [s for s in seqs if s.status is WAITING]
    assert (len(running), len(waiting)) == (sched.num_running, sched.num_waiting)
    holders = Counter(b for s in running for b in s.block_table)
    assert all(bm.ref_count(b) == holders[b] for b in range(bm.num_total_blocks))
    free = bm.free_block_ids()
    assert len(free) == len(set(free)) == bm.num_free_blocks
    assert not set(free) & set(holders), "a block is both free and in use"
    assert len(free) + len(holders) == bm.num_total_blocks
    for s in running:
        assert len(s.block_table) == math.ceil(s.num_computed_tokens / BS) == len(set(s.block_table))
        assert s.num_computed_tokens < s.num_tokens <= sched.config.max_model_len
    assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in waiting)
    assert all(s.block_table == [] for s in seqs if s.status is FINISHED)
    hashes = [h for h in map(bm.block_hash, range(bm.num_total_blocks)) if h is not None]
    assert len(hashes) == len(set(hashes)) == bm.num_cached_blocks
    assert bm.num_claimed_blocks <= sum(math.ceil(s.num_tokens / BS) for s in running)


@pytest.mark.parametrize("seed,long_prefill_chunk", [(0, None), (1, 5), (2, None), (3, 3)])
def test_randomized_run_keeps_invariants_and_matches_the_reference(seed, long_prefill_chunk) -> None:
    rng = random.Random(seed)
    sched, bm, runner = make(num_blocks=12, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_chunk=long_prefill_chunk, eos_token_ids=(7,))
    bases = [[rng.randrange(1000) for _ in range(n)] for n in (8, 12, 5)]  # shared system prompts
    seqs: list[Sequence] = []
    while len(seqs) < 60 or sched.has_unfinished():
        if len(seqs) < 60 and rng.random() < 0.5:
            prompt = rng.choice(bases) + [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
            seqs.append(seq_of(len(seqs), prompt, max_tokens=rng.randrange(1, 16)))
            sched.add(seqs[-1])
        live = [s for s in seqs if not s.is_finished]
        if live and rng.random() < 0.04:
            sched.abort(rng.choice(live).seq_id)
        if live and rng.random() < 0.02:
            sched.finish(rng.choice(live).seq_id, FinishReason.STOP)
        step(sched, runner)
        check_invariants(sched, bm, seqs)
    for s in seqs:
        assert s.output_token_ids == reference_tokens(s.prompt_token_ids, len(s.output_token_ids))
        if s.finish_reason is FinishReason.LENGTH:
            assert len(s.output_token_ids) == s.params.max_tokens or s.num_tokens == 40
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_claimed_blocks == 0
    assert sum(s.num_preemptions for s in seqs) > 0 and bm.hit_tokens_total > 0  # both paths ran


def test_min_tokens_holds_off_eos_until_that_many_tokens_were_generated() -> None:
    # EOS (id 0 here) is sampled at every step; with min_tokens 3 the first three are ignored and the
    # fourth ends the sequence: 4 tokens in all, as vLLM counts it.
    blocks = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                                          eos_token_ids=(0,)), blocks)
    seq = Sequence(seq_id=1, prompt_token_ids=(5, 6, 7), params=SamplingParams(max_tokens=10, min_tokens=3))
    scheduler.add(seq)
    reasons = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        output = ModelOutput(tuple(SampledToken(s.seq_id, 0) for s in batch.seqs if s.sample))
        reasons += [r.finish_reason for r in scheduler.update(batch, output)]
    assert reasons == [None, None, None, FinishReason.STOP]
