"""Turn one step's logits into one token per sampling sequence.

The order follows vLLM: logit bias -> presence/frequency penalties -> temperature -> top-k -> top-p -> sample.
Greedy rows (temperature 0) take the argmax of the penalized logits. Logprobs are taken from the
raw logits (before any of those), as vLLM reports them by default.

Sampling is the Gumbel-max trick: with E ~ Exp(1) per token, argmax(logit / T - log E) is a draw from
softmax(logit / T). No normalisation is needed, so the score of a token does not depend on which
other tokens sit in the same tensor. A seeded request draws its noise from its own generator, one
value per vocabulary entry in token-id order, whatever the batch around it; so the same seed gives
the same tokens alone or in any batch.

Cost (the engine samples every step): greedy rows are one argmax. Top-k rows work on the k best
candidates from `topk` instead of sorting the vocabulary (a full sort of [64, 49152] takes ~250 ms on
a small CPU, topk(50) ~8 ms). Only top-p without top-k sorts the whole row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from kvgate.engine.sequence import SampledToken, SamplingParams, ScheduledSeq

# Exp(1) noise of exactly 0 would make -log(E) infinite: a token with probability 0 could win.
_MIN_NOISE = 1e-20
# With every sampling row under top-k, restrict to the best max(k) candidates when max(k) is at
# most this share of the vocabulary; above it a full sort is about as cheap.
_TOPK_PATH_MAX_SHARE = 0.25


class Sampler:
    """Samples one token per row of logits. Holds per-request random generators between steps.

    Requests with `params.seed` get their own generator, seeded on first use and kept until
    `release()` (across preemption, so a recomputed request draws the same tokens). Requests without
    a seed share one sampler-level generator, seeded from `seed` when given (tests) or from fresh
    entropy otherwise. Generators live on the device of the logits.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: torch.Generator | None = None
        self._per_seq: dict[int, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
                 raw_logits: torch.Tensor | None = None) -> list[SampledToken]:
        """`logits`: float32 [len(seqs), vocab], row i for seqs[i]. Returns one token per row, in order.
        `raw_logits`: the model's logits before a grammar masked them, which logprobs report (default `logits`).

        `logits` is not modified. Raises ValueError when the shapes disagree.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs)={len(seqs)}, vocab]; got {tuple(logits.shape)}")
        penalized = _apply_bias_and_penalties(logits, seqs)
        token_ids = penalized.argmax(dim=-1)  # the answer for greedy rows; cheap for all rows at once
        sample_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sample_rows:
            sampled = self._sample(penalized[sample_rows], [seqs[i] for i in sample_rows])
            token_ids[torch.tensor(sample_rows, device=logits.device)] = sampled
        chosen = token_ids.tolist()
        logprob_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not logprob_rows:
            return [SampledToken(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, chosen)]
        return _with_logprobs(logits if raw_logits is None else raw_logits, seqs, chosen, logprob_rows)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Drop the generators of finished or aborted sequences. Unknown ids are ignored (idempotent)."""
        for seq_id in seq_ids:
            self._per_seq.pop(seq_id, None)

    @property
    def num_generators(self) -> int:
        """Per-request generators currently held (for tests and leak checks)."""
        return len(self._per_seq)

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """One draw per row from the tempered, filtered distribution. Returns token ids [rows]."""
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
        temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        scaled = logits / temperatures.unsqueeze(1)
        if all(p.top_k == 0 and p.top_p == 1.0 for p in params):
            return (scaled + self._gumbel(seqs, None, vocab, scaled)).argmax(dim=-1)
        # Work on candidates sorted best first: the top max(k) when every row has a top-k, else all.
        max_k = max(p.top_k for p in params)
        if all(p.top_k > 0 for p in params) and max_k <= _TOPK_PATH_MAX_SHARE * vocab:
            values, candidate_ids = scaled.topk(max_k, dim=-1)
        else:
            values, candidate_ids = scaled.sort(dim=-1, descending=True)
        values = _mask_top_k_top_p(values, params)
        best = (values + self._gumbel(seqs, candidate_ids, vocab, values)).argmax(dim=-1, keepdim=True)
        return candidate_ids.gather(1, best).squeeze(1)

    def _gumbel(self, seqs: list[ScheduledSeq], candidate_ids: torch.Tensor | None, vocab: int,
                like: torch.Tensor) -> torch.Tensor:
        """-log(Exp(1)) noise shaped like `like`: for token candidate_ids[r, c] (or token c when
        candidate_ids is None). A seeded row draws `vocab` values in token order from its own
        generator and picks its candidates' values, so its noise for a token never depends on
        what else is in the batch. Unseeded rows share one generator and draw only what they use."""
        noise = torch.empty_like(like)
        shared_rows = [r for r, s in enumerate(seqs) if s.params.seed is None]
        if len(shared_rows) == len(seqs):
            noise.exponential_(generator=self._shared_generator(like.device))
        else:
            if shared_rows:
                shared = torch.empty((len(shared_rows), like.shape[1]), dtype=like.dtype, device=like.device)
                noise[shared_rows] = shared.exponential_(generator=self._shared_generator(like.device))
            for row, seq in enumerate(seqs):
                if seq.params.seed is None:
                    continue
                generator = self._generator_for(seq, like.device)
                if candidate_ids is None:
                    noise[row].exponential_(generator=generator)  # in place: no copy of a vocab row
                else:
                    full = torch.empty(vocab, dtype=like.dtype, device=like.device)
                    noise[row] = full.exponential_(generator=generator)[candidate_ids[row]]
        return noise.clamp_(min=_MIN_NOISE).log_().neg_()

    def _generator_for(self, seq: ScheduledSeq, device: torch.device) -> torch.Generator:
        generator = self._per_seq.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seq.params.seed)
            self._per_seq[seq.seq_id] = generator
        return generator

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._shared is None:
            self._shared = torch.Generator(device=device)
            if self._seed is None:
                self._shared.seed()
            else:
                self._shared.manual_seed(self._seed)
        return self._shared


def _apply_bias_and_penalties(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """Logit bias, then OpenAI's penalties over the tokens generated so far (not the prompt):
    logit[t] += logit_bias[t] - presence_penalty * (count[t] > 0) - frequency_penalty * count[t].

    Worked numbers: output (5, 5, 7), presence 0.5, frequency 0.25 -> logit[5] -= 0.5 + 2 * 0.25 = 1.0,
    logit[7] -= 0.5 + 0.25 = 0.75; with logit_bias {7: 2.0}, logit[7] changes by +1.25 instead.
    Sparse: only the (row, token) pairs biased or generated so far change, so the cost is their number,
    not rows x vocab. Returns `logits` itself when no row has bias or penalties, else a new tensor.
    """
    vocab = logits.shape[1]
    flat_index: list[int] = []
    deltas: list[float] = []
    for row, seq in enumerate(seqs):
        for token_id, bias in seq.params.logit_bias:
            if token_id < vocab:  # the server refuses ids past the vocabulary; a padded vocabulary may be wider
                flat_index.append(row * vocab + token_id)
                deltas.append(bias)
        presence, frequency = seq.params.presence_penalty, seq.params.frequency_penalty
        if not (presence or frequency) or not seq.output_token_ids:
            continue
        for token_id, count in Counter(seq.output_token_ids).items():
            flat_index.append(row * vocab + token_id)
            deltas.append(-(presence + frequency * count))
    if not flat_index:
        return logits
    penalized = logits.clone()
    index = torch.tensor(flat_index, device=logits.device)
    # index_add_ sums a token that is both biased and penalized
    penalized.view(-1).index_add_(0, index, torch.tensor(deltas, dtype=logits.dtype, device=logits.device))
    return penalized


def _mask_top_k_top_p(values: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`values`: each row's candidates sorted best first. Set to -inf what top-k and top-p drop.

    Top-k keeps the first k candidates (ties at the k-th value are broken by the sort). Top-p keeps
    the shortest prefix whose probability reaches p: a candidate stays if the mass before it is < p.
    Worked numbers: probabilities (0.5, 0.3, 0.15, 0.05), p 0.7 -> mass before (0, 0.5, 0.8, 0.95) ->
    keep the first two. The best candidate always stays, so top_p -> 0 is greedy.
    """
    num_candidates = values.shape[1]
    if any(p.top_k > 0 for p in params):
        k = torch.tensor([p.top_k if p.top_k > 0 else num_candidates for p in params], device=values.device)
        position = torch.arange(num_candidates, device=values.device)
        values = values.masked_fill(position.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # Rows without top-p get a threshold above 1: a rounded cumsum must not trim their tail.
        top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], values)
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        values = values.masked_fill(mass_before >= top_p, float("-inf"))
    return values


def _with_logprobs(raw: torch.Tensor, seqs: Sequence[ScheduledSeq], chosen: list[int],
                   rows: list[int]) -> list[SampledToken]:
    """Tokens with the chosen token's logprob and the top-n, from log_softmax of the raw logits."""
    logprobs = raw[rows].float().log_softmax(dim=-1)
    chosen_ids = torch.tensor([chosen[i] for i in rows], device=raw.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
    num_top = max(seqs[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # sorted, best first; k = 0 is allowed
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    by_row = {}
    for j, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        by_row[i] = (chosen_logprobs[j], tuple(zip(top_ids[j][:n], top_values[j][:n])))
    out = []
    for i, (seq, token_id) in enumerate(zip(seqs, chosen)):
        if i in by_row:
            logprob, top = by_row[i]
            out.append(SampledToken(seq_id=seq.seq_id, token_id=token_id, logprob=logprob, top_logprobs=top))
        else:
            out.append(SampledToken(seq_id=seq.seq_id, token_id=token_id))
    return out


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)
