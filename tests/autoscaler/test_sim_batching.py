"""One replica's engine steps in the simulator (`autoscaler/sim/batching.py`): chunked prefill under the token
budget beside decode, with worked numbers."""

from __future__ import annotations

import pytest

from kvgate.autoscaler.sim.batching import ReplicaBatch
from kvgate.autoscaler.sim.service import ServiceModel

# decode step 8 / 400 = 0.02 s; 10,000 prefill tokens/s; 2,048 tokens a step
SERVICE = ServiceModel("X", prefill_tokens_per_s=10_000, decode_tokens_per_s=400, max_batch=8, max_batch_tokens=2048)


def run(batch: ReplicaBatch, next_at: float | None, until: float = 1e9) -> dict[int, tuple[float, float]]:
    """Step the replica through its events; each request's (first token, last token) time."""
    first: dict[int, float] = {}
    times: dict[int, tuple[float, float]] = {}
    while next_at is not None and next_at <= until:
        now = next_at
        done = batch.advance(now)
        first.update((index, now) for index in done.first_tokens)
        times.update((index, (first[index], now)) for index in done.ended)
        next_at = done.next_at
    return times


def test_decode_alone_runs_one_token_a_step() -> None:
    batch = ReplicaBatch(SERVICE)
    times = run(batch, batch.admit(0.0, 0, 100, 11))
    # 100 tokens prefill in 0.01 s (nothing decodes yet, so no decode step in it); 10 more tokens, 0.02 s each
    assert times[0] == pytest.approx((0.01, 0.21))


def test_a_long_prompt_spans_steps_and_lengthens_the_decodes_beside_it() -> None:
    # The module docstring's example: 8 sequences decoding when a 3,000-token prompt arrives.
    batch = ReplicaBatch(SERVICE)
    next_at = None
    for index in range(8):
        next_at = batch.admit(0.0, index, 1, 1000) or next_at
    started: list[int] = []
    while batch.prefilling:  # the first prompt's step, then the other seven together beside its decode
        start = next_at
        done = batch.advance(start)
        started += done.first_tokens
        next_at = done.next_at
    assert started == list(range(8))
    steps = batch.steps  # the 8 decode from `start` on
    next_at = batch.admit(start, 8, 3000, 1)
    assert next_at == pytest.approx(start + 0.02 + 2040 / 10_000)  # 2,048 less the 8 decode tokens
    done = batch.advance(next_at)
    assert done.first_tokens == ()
    next_at = done.next_at
    assert next_at - start == pytest.approx(0.224 + 0.02 + 960 / 10_000)
    done = batch.advance(next_at)
    assert done.first_tokens == (8,) and done.ended == (8,)  # its first token at 0.340 s (0.300 s alone)
    assert batch.steps - steps == pytest.approx(2)  # the 8 decoded 2 tokens in 0.340 s, not 17


def test_first_token_estimate_counts_the_prompts_ahead() -> None:
    batch = ReplicaBatch(SERVICE)
    assert batch.first_token_estimate(0.0, 1000) == pytest.approx(0.1)  # idle: its own prefill
    batch.admit(0.0, 0, 2000, 5)  # a step of 2,000 tokens under way until 0.2 s
    assert batch.first_token_estimate(0.0, 1000) == pytest.approx(0.3)


def test_cleared_it_holds_nothing_and_its_old_events_are_stale() -> None:
    batch = ReplicaBatch(SERVICE)
    batch.admit(0.0, 0, 5000, 5)
    batch.admit(0.0, 1, 10, 5)
    version = batch.version
    assert batch.clear() == [0, 1]
    assert len(batch) == 0 and batch.pending_tokens == 0 and batch.version != version
