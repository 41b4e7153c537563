"""The sampler: greedy, temperature, top-k/top-p, penalties, per-request seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvgate.engine.runner.sampler import Sampler
from kvgate.engine.sequence import SamplingParams, ScheduledSeq

VOCAB = 64


def seq(seq_id: int, output: tuple[int, ...] = (), **params: object) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=seq_id, token_ids=(1,), start_pos=0, block_table=(0,), sample=True,
        params=SamplingParams(**params), output_token_ids=output,
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_argmax_of_each_row() -> None:
    logits = random_logits(4)
    tokens = Sampler(seed=0)(logits, [seq(i, temperature=0.0) for i in range(4)])
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert [t.seq_id for t in tokens] == [0, 1, 2, 3]
    assert all(t.logprob is None and t.top_logprobs == () for t in tokens)


def test_the_logits_are_not_modified() -> None:
    logits = random_logits(2)
    before = logits.clone()
    Sampler(seed=0)(logits, [seq(0, output=(3, 3), frequency_penalty=1.0), seq(1, top_k=3, top_p=0.5)])
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(8)
    sampler = Sampler(seed=0)
    for _ in range(5):
        tokens = sampler(logits, [seq(i, temperature=1.5, top_k=1) for i in range(8)])
        assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()


def test_a_tiny_top_p_equals_greedy() -> None:
    logits = random_logits(8)
    sampler = Sampler(seed=0)
    for _ in range(5):
        tokens = sampler(logits, [seq(i, temperature=1.0, top_p=1e-6) for i in range(8)])
        assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_among_the_k_most_likely() -> None:
    logits = random_logits(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(seed=0)
    drawn = {sampler(logits, [seq(0, temperature=5.0, top_k=3)])[0].token_id for _ in range(200)}
    assert drawn == allowed  # all three show up at a high temperature, nothing else ever does


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    drawn = Counter(sampler(logits, [seq(0, top_p=0.7)])[0].token_id for _ in range(400))
    assert set(drawn) == {0, 1}
    assert 0.5 < drawn[0] / 400 < 0.75  # renormalised: 0.5 / 0.8 = 0.625


def test_temperature_sampling_follows_the_softmax() -> None:
    # logits (ln 1, ln 3) at temperature 1 -> p = (0.25, 0.75)
    logits = torch.log(torch.tensor([[1.0, 3.0]]))
    sampler = Sampler(seed=1)
    counts = Counter(sampler(logits, [seq(0)])[0].token_id for _ in range(2000))
    assert abs(counts[1] / 2000 - 0.75) < 0.04
    # temperature 0.5 squares the odds: 1:9 -> p = (0.1, 0.9)
    counts = Counter(sampler(logits, [seq(0, temperature=0.5)])[0].token_id for _ in range(2000))
    assert abs(counts[1] / 2000 - 0.9) < 0.03


def test_a_seed_reproduces_the_same_tokens() -> None:
    logits = random_logits(1)

    def run() -> list[int]:
        sampler = Sampler()
        return [sampler(logits, [seq(7, seed=1234, temperature=2.0)])[0].token_id for _ in range(20)]

    first = run()
    assert first == run()
    assert len(set(first)) > 1  # it really samples


def test_a_seeded_request_is_independent_of_the_batch_around_it() -> None:
    logits = random_logits(4)
    alone, batched = Sampler(seed=1), Sampler(seed=2)
    tokens_alone, tokens_batched = [], []
    for _ in range(20):
        tokens_alone.append(alone(logits[2:3], [seq(7, seed=99, temperature=2.0, top_p=0.9)])[0].token_id)
        batch = [seq(1, temperature=2.0), seq(2, temperature=0.0), seq(7, seed=99, temperature=2.0, top_p=0.9),
                 seq(3, seed=5, temperature=1.0, top_k=10)]
        tokens_batched.append(batched(logits, batch)[2].token_id)
    assert tokens_alone == tokens_batched


def test_a_seeded_top_k_request_draws_the_same_in_the_sorting_path() -> None:
    # Alone, a top-k row works on topk() candidates; next to a top-p-only row the batch sorts the
    # whole vocabulary. The seeded row must not notice.
    logits = random_logits(2)
    alone, batched = Sampler(), Sampler()
    for _ in range(20):
        a = alone(logits[:1], [seq(7, seed=42, temperature=3.0, top_k=8)])[0].token_id
        b = batched(logits, [seq(7, seed=42, temperature=3.0, top_k=8), seq(8, top_p=0.5)])[0].token_id
        assert a == b


def test_different_seeds_give_different_tokens() -> None:
    logits = random_logits(1)
    sampler = Sampler()
    a = [sampler(logits, [seq(1, seed=1, temperature=2.0)])[0].token_id for _ in range(20)]
    b = [sampler(logits, [seq(2, seed=2, temperature=2.0)])[0].token_id for _ in range(20)]
    assert a != b


def test_release_drops_the_generator_and_a_reused_id_starts_over() -> None:
    logits = random_logits(1)
    sampler = Sampler()
    first = [sampler(logits, [seq(7, seed=3, temperature=2.0)])[0].token_id for _ in range(10)]
    assert sampler.num_generators == 1
    sampler.release([7, 12345])  # unknown ids are ignored
    assert sampler.num_generators == 0
    again = [sampler(logits, [seq(7, seed=3, temperature=2.0)])[0].token_id for _ in range(10)]
    assert again == first


def test_greedy_and_unseeded_requests_hold_no_generator() -> None:
    sampler = Sampler()
    sampler(random_logits(2), [seq(1, temperature=0.0, seed=4), seq(2)])
    assert sampler.num_generators == 0


def test_presence_and_frequency_penalties_follow_openai() -> None:
    # All logits 0 except token 5 (2.0) and token 7 (1.0); the output so far is (5, 5, 7).
    # presence 0.5, frequency 0.25: token 5 -> 2.0 - 0.5 - 2 * 0.25 = 1.0; token 7 -> 1.0 - 0.5 - 0.25 = 0.25.
    logits = torch.zeros(1, 8)
    logits[0, 5], logits[0, 7] = 2.0, 1.0
    params = dict(presence_penalty=0.5, frequency_penalty=0.25, logprobs=8)
    sampler = Sampler(seed=0)
    penalized = [seq(0, output=(5, 5, 7), temperature=0.0, **params)]
    assert sampler(logits, penalized)[0].token_id == 5  # 1.0 is still the largest
    # Check the distribution itself: sample at temperature 1 and compare with softmax(1.0, 0.25, 0...).
    expected = torch.zeros(8)
    expected[5], expected[7] = 1.0, 0.25
    expected = expected.softmax(dim=0)
    counts = Counter(sampler(logits, [seq(0, output=(5, 5, 7), **params)])[0].token_id for _ in range(4000))
    assert abs(counts[5] / 4000 - expected[5].item()) < 0.03  # 0.2214
    assert abs(counts[7] / 4000 - expected[7].item()) < 0.03  # 0.1046


def test_a_strong_frequency_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    tokens = Sampler(seed=0)(logits, [seq(0, output=(0, 0), temperature=0.0, frequency_penalty=1.0),
                                      seq(1, output=(0, 0), temperature=0.0)])
    assert [t.token_id for t in tokens] == [1, 0]  # 3 - 2 * 1.0 = 1 < 2; the second row has no penalty


def test_negative_penalties_encourage_repetition() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    token = Sampler(seed=0)(logits, [seq(0, output=(1,), temperature=0.0, presence_penalty=-2.0)])[0]
    assert token.token_id == 1  # 0 + 2 > 1


def test_logprobs_are_from_the_raw_logits_sorted_best_first() -> None:
    logits = random_logits(3)
    seqs = [seq(0, temperature=0.0, logprobs=5), seq(1, temperature=0.0), seq(2, temperature=0.7, logprobs=0,
                                                                                output=(1, 2), presence_penalty=2.0)]
    tokens = Sampler(seed=0)(logits, seqs)
    expected = logits.log_softmax(dim=-1)
    first = tokens[0]
    assert first.logprob == pytest.approx(expected[0, first.token_id].item(), abs=1e-6)
    top_ids = [token_id for token_id, _ in first.top_logprobs]
    assert top_ids == expected[0].topk(5).indices.tolist()
    values = [value for _, value in first.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-6)
    assert math.exp(values[0]) <= 1.0
    assert tokens[1].logprob is None and tokens[1].top_logprobs == ()
    # logprobs=0: only the chosen token's logprob, unaffected by the penalty and the temperature.
    assert tokens[2].top_logprobs == ()
    assert tokens[2].logprob == pytest.approx(expected[2, tokens[2].token_id].item(), abs=1e-6)


def test_a_mismatched_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="len\\(seqs\\)=1"):
        Sampler()(random_logits(2), [seq(0)])
