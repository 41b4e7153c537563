"""The engine's shared value types: what a request asks for, its state, and the messages between the
scheduler and the runner. Plain Python (no torch), so scheduling is testable in microseconds.

One engine step is three calls (as in nano-vllm and vLLM v1):
    batch = scheduler.schedule()            -> ModelInput (which tokens of which sequences to compute)
    output = runner.execute(batch)          -> ModelOutput (one sampled token per sequence that samples)
    scheduler.update(batch, output)         -> appends tokens, frees finished sequences
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's maximum length
    ABORT = "abort"  # cancelled by the caller (client went away)


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # the source is a JSON schema as JSON text
    LARK = "lark"  # the source is a Lark grammar in llguidance's dialect (%json {...} rules allowed)


@dataclass(frozen=True)
class Constraint:
    """What a constrained output must match (engine/structured.py compiles it)."""

    kind: ConstraintKind
    source: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ConstraintKind(self.kind))  # "json_schema" reads as the enum


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop; the meaning follows OpenAI's and vLLM's APIs."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop token ids are ignored until this many tokens were generated
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with this much probability
    top_k: int = 0  # keep the k most likely tokens; 0 means all
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token generated so far
    stop: tuple[str, ...] = ()  # stop strings; the output never contains them, nor a partial one
    stop_token_ids: tuple[int, ...] = ()  # stop on these tokens in addition to EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's logprob and the top n
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, -100 to 100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None  # the output must match this (JSON schema, grammar)
    n: int = 1  # samples of the prompt; they share its KV blocks (engine/scheduler.py forks them)
    skip_special_tokens: bool = True  # False keeps special tokens in the text (tool-call tags some models mark special)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"an integer from 0 to max_tokens ({self.max_tokens})")
        _check(math.isfinite(self.temperature) and 0 <= self.temperature <= 100, "temperature",
               self.temperature, "a number from 0 to 100")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "0 (all) or a positive integer")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "a number from -2 to 2")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "a number from -2 to 2")
        _check(all(s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "0 to 20")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        _check(all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias", self.logit_bias,
               "token ids >= 0 with biases from -100 to 100")
        _check(self.n >= 1, "n", self.n, "an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    FORKING = "forking"  # a further sample of a prompt (n > 1): waits for its first sample's prefill to share it
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. Owned and mutated by the scheduler only."""

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    adapter: str | None = None  # LoRA adapter name; part of every prefix-cache hash
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (cached prefix included)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when first scheduled
    block_table: list[int] = field(default_factory=list)  # physical block ids, in position order
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Chained prefix-cache hashes of the full blocks of all_token_ids hashed so far: the block manager
    # extends it as tokens are known, so each block is hashed once however often the sequence is looked up.
    block_hashes: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class ScheduledSeq:
    """The work for one sequence in one step: compute KV for `token_ids` at positions
    start_pos .. start_pos + len(token_ids) - 1, and sample the next token if `sample`."""

    seq_id: int
    token_ids: tuple[int, ...]  # a prefill chunk, or the single newest token when decoding
    start_pos: int  # = tokens already in the KV cache for this sequence
    block_table: tuple[int, ...]  # physical blocks covering positions 0 .. start_pos + len(token_ids) - 1
    sample: bool  # this chunk reaches the sequence's last token, so a next token is sampled
    params: SamplingParams
    output_token_ids: tuple[int, ...]  # generated so far, for presence/frequency penalties
    adapter: str | None = None
    # The further samples (n > 1) that fork from this sequence once its prompt is computed: (seq_id, params)
    # each. Each samples its own first token from this sequence's logits; the sampler sees them as rows.
    forks: tuple[tuple[int, SamplingParams], ...] = ()


@dataclass(frozen=True)
class ModelInput:
    """What the scheduler hands the runner for one step."""

    seqs: tuple[ScheduledSeq, ...]
    # Sequences that finished or were aborted since the last step, or forks that start over (their drawn
    # token dropped): the runner drops their per-sequence state (random generators). Preempted sequences
    # are not released: their sampling state must survive recomputation so a seeded request gives the same
    # tokens either way.
    released_seq_ids: tuple[int, ...] = ()
    # KV blocks to copy, (source, destination), before this step's forward pass: the partly filled last
    # prompt block of each forked sample, which it is about to write its own tokens into (copy on write).
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None  # log-probability of token_id under the model (before sampling tweaks)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the n most likely (token_id, logprob), best first


@dataclass(frozen=True)
class ModelOutput:
    """What the runner answers: one token for each scheduled sequence with `sample` set, same order."""

    sampled: tuple[SampledToken, ...]
